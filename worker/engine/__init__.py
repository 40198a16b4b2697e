"""Engines behind one API: add_request(id, prompt_ids, params), abort(id), step() -> outputs.

Engines know nothing of Redis or HTTP.
"""
