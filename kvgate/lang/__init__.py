"""kvgate.lang: multi-step generation programs (SGLang's frontend shape) over kvgate's prefix cache.

    from kvgate.lang import function, gen, select, user, assistant, Endpoint, set_default_backend

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    set_default_backend(Endpoint("http://127.0.0.1:8000", api_key, "demo"))
    print(qa.run(question="Why is the sky blue?")["answer"])

docs/programs.md describes the language, how it maps onto requests and the prefix cache, and what it
does not do."""
from kvgate.lang.backends import Backend, BackendError, Endpoint
from kvgate.lang.errors import ProgramError
from kvgate.lang.ops import assistant, gen, select, system, user
from kvgate.lang.program import Program, function, set_default_backend
from kvgate.lang.state import ForkGroup, ProgramState


def __getattr__(name: str):
    if name == "Local":  # imports the engine (torch): only when asked for
        from kvgate.lang.local import Local

        return Local
    raise AttributeError(name)


__all__ = ["Backend", "BackendError", "Endpoint", "ForkGroup", "Local", "Program", "ProgramError", "ProgramState",
           "assistant", "function", "gen", "select", "set_default_backend", "system", "user"]
