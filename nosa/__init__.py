"""nosa: trainable, offload-friendly block-sparse attention (NOSA).

Only torch is needed to import this package; transformers is imported when nosa.hf is used. Once
transformers has built its Auto classes, the NOSA model types are registered with them, so a plain
``AutoModelForCausalLM.from_pretrained`` of a NOSA checkpoint gives the NOSA model (nosa.hf_models).
The reference implementation (nosa.select, nosa.attention) is the spec that kernels and the
SGLang backend are tested against.
"""

import importlib.util as _importlib_util
import os as _os
import sys as _sys

from nosa import after_import as _after_import
from nosa.attention.math import dense_attention
from nosa.attention.prefill import nosa_prefill, nosa_prefill_varlen
from nosa.config import NosaConfig
from nosa.decode import NosaDecodeState
from nosa.eviction import EvictionHead, block_eviction_scores
from nosa.select import blocks_entering, query_block_scores, select_blocks

__version__ = "0.1.0"

# The repository keeps kernels/, train/ and serve/ at its top level (the design card) and imports
# them as nosa.kernels / nosa.train / nosa.serve. Those folders have no __init__.py on purpose: a
# regular package named `kernels` at the repository root would shadow PyPI's `kernels` (which SGLang
# imports) whenever Python runs from there. An installed wheel has them under nosa/ and they import
# natively; in a source checkout (editable install) we attach them here as namespace packages,
# because setuptools' editable finder cannot map a namespace folder under a regular package.
_FOLDER_PACKAGES = ("kernels", "train", "serve")


def _attach_folder_packages() -> None:
    here = _os.path.dirname(_os.path.abspath(__file__))
    for name in _FOLDER_PACKAGES:
        full = f"{__name__}.{name}"
        folder = _os.path.join(_os.path.dirname(here), name)
        if full in _sys.modules or _os.path.isdir(_os.path.join(here, name)) or not _os.path.isdir(folder):
            continue
        spec = _importlib_util.spec_from_loader(full, None, is_package=True)
        spec.submodule_search_locations = [folder]
        module = _importlib_util.module_from_spec(spec)
        _sys.modules[full] = module
        globals()[name] = module


_attach_folder_packages()


# convert and from_pretrained are the one route to nosa.hf_models' functions (the project's own code
# calls them too), wrapped here rather than re-exported because nosa.hf_models imports transformers
# and `import nosa` must not.
def convert(model, config: NosaConfig | None = None):
    """Turn a transformers Llama / Qwen2 / Qwen3 causal LM into NOSA in place (see nosa.hf_models.convert)."""
    from nosa.hf_models import convert as _convert  # optional: transformers (import nosa needs only torch)

    return _convert(model, config)


def from_pretrained(path: str, config: NosaConfig | None = None, **kwargs):
    """Load a NOSA (or dense) checkpoint as a NOSA model (see nosa.hf_models.from_pretrained)."""
    from nosa.hf_models import from_pretrained as _from_pretrained  # optional: transformers, as above

    return _from_pretrained(path, config, **kwargs)


def _register_configs() -> None:
    import nosa.hf_configs  # noqa: F401  # optional: transformers; importing it registers the NOSA config classes


def _register_models() -> None:
    import nosa.hf_models  # noqa: F401  # optional: transformers; importing it registers the NOSA causal-LM classes


# AutoConfig / AutoModelForCausalLM learn the NOSA model types when transformers builds them (now,
# if it already has), without `import nosa` importing transformers (nosa.after_import).
_after_import.when_imported("transformers.models.auto.configuration_auto", _register_configs, quiet="transformers")
_after_import.when_imported("transformers.models.auto.modeling_auto", _register_models, quiet="transformers")

__all__ = [
    "NosaConfig",
    "EvictionHead",
    "NosaDecodeState",
    "block_eviction_scores",
    "blocks_entering",
    "convert",
    "dense_attention",
    "from_pretrained",
    "nosa_prefill",
    "nosa_prefill_varlen",
    "query_block_scores",
    "select_blocks",
]
