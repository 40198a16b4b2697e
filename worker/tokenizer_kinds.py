"""The entries a worker answers from its tokenizer alone (vLLM's /tokenize and /detokenize, schema
v5): no KV, no engine step, so they never wait behind generation for a place in the batch."""
from __future__ import annotations

from shared import protocol
from worker.engine.tokenizer import decode_ids, encode_prompt, render_chat


def answer(tokenizer, entry: protocol.RequestEntry, seq: int, max_model_len: int) -> tuple[protocol.Delta, int]:
    """The one delta that answers `entry`, and the prompt tokens it counted (what its Done says).
    Raises EngineRejected (the request's fault: a 400) for ids out of range or a template that
    refuses the messages."""
    rid = entry.request_id
    if entry.kind == "detokenize":
        ids = list(entry.prompt_token_ids or ())
        return protocol.Delta(request_id=rid, seq=seq, text=decode_ids(tokenizer, ids, max_model_len)), len(ids)
    opts = entry.render or protocol.RenderOptions()
    if entry.messages is not None:
        ids = render_chat(tokenizer, entry.messages, entry.tools, entry.chat_template_kwargs,
                          opts.add_generation_prompt, opts.continue_final_message, opts.add_special_tokens)
    else:
        ids = encode_prompt(tokenizer, entry.prompt or "", opts.add_special_tokens)
    strs = list(tokenizer.convert_ids_to_tokens(ids)) if opts.return_token_strs else None
    return protocol.Delta(request_id=rid, seq=seq, token_ids=ids, token_strs=strs), len(ids)
