"""moebox: run frontier-size Mixture-of-Experts LLMs (DeepSeek-V4) on one memory-limited machine."""

from moebox.runtime.llm import LLM, CompletionOutput, RequestOutput
from moebox.runtime.sampler import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
