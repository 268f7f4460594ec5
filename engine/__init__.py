"""kvllm engine: continuous batching over a paged KV cache.

    from engine import Engine, SamplingParams
    llm = Engine(model="smollm2")
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text)
"""
from engine.errors import EngineDeadError, InvalidRequestError
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_params import StructuredOutputsParams


def __getattr__(name):  # Engine pulls in the model code; import it lazily
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineStats", "InvalidRequestError",
           "EngineDeadError"]
