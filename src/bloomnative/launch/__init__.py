"""The job runtime: what runs around the training processes, not inside them.

- `cli`: what `./run_train.sh` runs (`python -m bloomnative.launch.cli`): reads the launcher's
  variables, runs `preflight` for every world size the job may have, then `torchrun`.
- `preflight`: every mistake in the user's input found before a worker starts, one line, exit 2.
- `torchrun`: torchrun in this process, stoppable (SIGTERM saves), with final errors not restarted.
- `rendezvous`: torchrun's rendezvous backend that names a lost node.
- `hang_report`: the one line naming the rank that did not arrive at a collective.
- `worker`: what torchrun starts on every rank (`python -m bloomnative.launch.worker`): the
  trainer (`bloomnative.train`), its errors mapped to exit codes.

The training loop imports nothing of this package (tests/test_import_graph.py).
"""
