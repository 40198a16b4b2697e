"""The entries a worker answers from its tokenizer alone (vLLM's /tokenize and /detokenize, schema
v5, and /tokenizer_info, v8): no KV, no engine step, so they never wait behind generation for a place
in the batch."""
from __future__ import annotations

import orjson

from shared import protocol
from worker.engine.tokenizer import decode_ids, encode_prompt, render_chat


def answer(tokenizer, entry: protocol.RequestEntry, seq: int, max_model_len: int) -> tuple[protocol.Delta, int]:
    """The one delta that answers `entry`, and the prompt tokens it counted (what its Done says).
    Raises EngineRejected (the request's fault: a 400) for ids out of range or a template that
    refuses the messages."""
    rid = entry.request_id
    if entry.kind == "tokenizer_info":
        return protocol.Delta(request_id=rid, seq=seq, text=orjson.dumps(info(tokenizer, max_model_len)).decode()), 0
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


def info(tokenizer, max_model_len: int) -> dict:
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does without the model
    folder (lm-evaluation-harness's remote tokenizer reads the special tokens and the chat template)."""
    def spelled(token) -> str | None:
        return None if token is None else str(token)  # an AddedToken as its text
    template = getattr(tokenizer, "chat_template", None)
    return {"tokenizer_class": type(tokenizer).__name__, "bos_token": spelled(tokenizer.bos_token),
            "eos_token": spelled(tokenizer.eos_token), "pad_token": spelled(tokenizer.pad_token),
            "unk_token": spelled(tokenizer.unk_token), "chat_template": template,
            "model_max_length": max_model_len, "vocab_size": len(tokenizer)}
