"""The served model's chat template as role markers, for clients that build a chat as text (kvgate.lang's
`system(...)`, `user(...)`, `assistant(...)`): each message is start[role] + content + end, the first
one preceded by `begin` (or `system_begin` when it is a system message), and a generated answer by
`generation` (add_generation_prompt's text).

Derived by rendering the template over sentinel contents and cutting at them, then checked by
rebuilding the sentinel conversation from the markers: a template that is not role-prefix/suffix
shaped (one that rewrites contents, or ends messages differently per role) gets None, and a client
says so instead of guessing. The worker publishes them in its registry entry; the model card carries
them. A BOS the template writes is left out when the tokenizer adds it to a completion prompt anyway.
"""
from __future__ import annotations

SENTINELS = ("\x00S0\x00", "\x00U1\x00", "\x00A2\x00", "\x00U3\x00")


def chat_markers(tokenizer) -> dict | None:
    """{"begin", "system_begin", "start": {role: text}, "end", "generation"}, or None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return _derive(tokenizer)
    except Exception:  # a template that refuses the sentinel conversation has no markers
        return None


def _render(tokenizer, roles: list[str], generation: bool) -> str:
    messages = [{"role": r, "content": SENTINELS[i]} for i, r in enumerate(roles)]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _cut(text: str, count: int) -> list[str]:
    """The text around the first `count` sentinels: count + 1 pieces."""
    pieces = []
    for sentinel in SENTINELS[:count]:
        head, found, text = text.partition(sentinel)
        if not found:
            raise ValueError("a sentinel is missing from the rendered template")
        pieces.append(head)
    return pieces + [text]


def _derive(tokenizer) -> dict | None:
    p0, g1, g2, g3, end = _cut(_render(tokenizer, ["system", "user", "assistant", "user"], False), 4)
    if not (g1 == g3 and g1.startswith(end) and g2.startswith(end)):
        return None
    start = {"user": g1[len(end):], "assistant": g2[len(end):]}
    generation = _cut(_render(tokenizer, ["system", "user"], True), 2)[2]
    if not generation.startswith(end):
        return None
    before_user = _cut(_render(tokenizer, ["user"], False), 1)[0]
    if not before_user.endswith(start["user"]):
        return None
    bos = getattr(tokenizer, "bos_token", None) or ""
    system_begin = bos if bos and p0.startswith(bos) else ""
    start["system"] = p0[len(system_begin):]
    markers = {"begin": before_user[:len(before_user) - len(start["user"])], "system_begin": system_begin,
               "start": start, "end": end, "generation": generation[len(end):]}
    rebuilt = markers["system_begin"] + "".join(start[r] + SENTINELS[i] + end for i, r in
                                                enumerate(["system", "user", "assistant", "user"]))
    if rebuilt != _render(tokenizer, ["system", "user", "assistant", "user"], False):
        return None
    if bos and _adds_bos(tokenizer):  # a completion prompt gets it from the tokenizer
        for key in ("begin", "system_begin"):
            markers[key] = markers[key].removeprefix(bos)
    return markers


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and ids[0] == getattr(tokenizer, "bos_token_id", None)
