"""specserve: LLM serving with speculative decoding on a Ray cluster."""

from specserve.types import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)
