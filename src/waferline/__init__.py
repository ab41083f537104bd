"""waferline: serve huge MoE models the way wafer-scale deployments do, and predict how fast they run."""

from waferline._version import __version__
from waferline.errors import ConfigError, RequestError, WaferlineError

__all__ = ["LLM", "SamplingParams", "Output", "WaferlineError", "ConfigError", "RequestError", "__version__"]


def __getattr__(name: str):
    # the engine needs torch; the planner does not, so import the engine lazily
    if name in ("LLM", "Output"):
        from waferline.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from waferline.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'waferline' has no attribute {name!r}")
