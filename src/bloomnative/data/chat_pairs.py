"""Chat records as (input, target) pairs, the rule ``tools/preprocess_data.py`` applies when it
writes pair datasets (``--json-keys inputs targets``) and a record holds ``messages`` instead of
``inputs`` and ``targets``::

    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."}]}

* the target is the content of the last message, which must be the assistant's;
* the input is the contents of every earlier message, in order, joined by newlines (roles are
  not written: BLOOMZ was trained on xP3's plain prompts, without a chat template). The example
  gives ``("Answer briefly.\\nCapital of France?", "Paris.")``; with ``--prepend-space`` the
  target is tokenized as ``" Paris."``, as xP3's targets were.

Earlier assistant messages are part of the input (no loss on them). For another template,
write ``inputs`` and ``targets`` yourself.
"""

from __future__ import annotations

ASSISTANT_ROLE = "assistant"


def pair_from_messages(messages: object) -> tuple[str, str]:
    """``(input, target)`` of a record's ``messages`` value.

    Raises:
        ValueError: the value breaks the rule; the message names the key, e.g.
            ``messages[2].content``.
    """
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError(
            "key 'messages' must be a list of at least two messages (the input, then the "
            f"assistant's answer), got {_describe(messages)}"
        )
    contents = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"key 'messages[{i}]' holds {_describe(message)}, expected an object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"key 'messages[{i}].{key}' holds {_describe(message.get(key))}, "
                    "expected a string"
                )
        contents.append(message["content"])
    last = len(messages) - 1
    if messages[last]["role"] != ASSISTANT_ROLE:
        raise ValueError(
            f"key 'messages[{last}].role' is {messages[last]['role']!r}: the last message is the "
            f"target and must be the {ASSISTANT_ROLE!r}'s"
        )
    if not contents[-1]:
        raise ValueError(f"key 'messages[{last}].content' is empty: the target has no text")
    if not any(contents[:-1]):
        raise ValueError(f"keys 'messages[0..{last - 1}].content' are empty: the input has no text")
    return "\n".join(contents[:-1]), contents[-1]


def _describe(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"a {type(value).__name__}"
