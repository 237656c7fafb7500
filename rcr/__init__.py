"""rcr: re-selectable prefix KV caches for vision-language model decoding (Rate-Controlled Refresh and
its comparison methods), inside Hugging Face transformers.

    import rcr
    out = rcr.generate(model, inputs, method=["full", "bacon", "rcr"], max_new_tokens=512)
    out["rcr"].sequences, out["rcr"].sample(0)["trigger"].mean()  # refresh fraction of sample 0
"""

from . import attention  # registers the "rcr" attention function with transformers
from .config import ConfigError, RCRConfig
from .generate import Decoder, GenerationResult, answer_attention_scores, decode, generate, prefill
from .methods import METHODS, load_entry_points, parse_method

load_entry_points()  # installed packages' methods (entry point group "rcr.methods"; docs/extending.md)

__all__ = ["RCRConfig", "ConfigError", "generate", "prefill", "decode", "Decoder", "GenerationResult",
           "answer_attention_scores", "METHODS", "parse_method", "attention"]
