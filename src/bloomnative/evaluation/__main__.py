"""`python -m bloomnative.evaluation ARGS`: lm-evaluation-harness's own command line (`lm_eval
ARGS`) with the "bloomnative" model registered, which `lm_eval` alone cannot see (the harness
finds only its own models and whatever is imported before it parses its arguments):

    python -m bloomnative.evaluation run --model bloomnative \\
        --model_args checkpoint=outputs/debug --tasks lambada_openai --limit 100
"""

from lm_eval.__main__ import cli_evaluate

import bloomnative.evaluation.harness_model  # noqa: F401  (registers "bloomnative")

if __name__ == "__main__":
    cli_evaluate()
