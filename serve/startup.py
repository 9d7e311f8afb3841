"""Start-up checks in SGLang's launcher: a checkpoint whose NosaConfig is malformed (its 'nosa'
section, or $NOSA_CONFIG for a dense checkpoint), and offloading settings that cannot work, stop the
server before any scheduler process starts (in seconds, rather than after the minute a scheduler
takes to import SGLang and load the model), with the same message the backend gives.

``install`` registers a hook on SGLang's server-argument resolution step ``handle_other_validations``
(it runs in the launcher, after the page size and attention backends are resolved). The backend runs
the same checks again as it starts (nosa.serve.backend, nosa.serve.offload.engine), so a server
started another way (``sglang.Engine``, a hub id the launcher cannot read) is checked too.
"""

from __future__ import annotations

import json
import os

from nosa.checkpoint_format import nosa_layers
from nosa.serve.offload.settings import OffloadSettings, offload_enabled

STEP = "handle_other_validations"
BACKEND_NAME = "nosa"
_INSTALLED: list = []


def check_hybrid_offload(sliding_layers: int, disable_radix_cache: bool) -> None:
    """A hybrid model's sliding-window layers keep their windows on the device per request when
    offloading, so a prefix from the radix cache (written by another request) would have none."""
    if sliding_layers and not disable_radix_cache:
        raise ValueError(
            "nosa backend: offloading a hybrid model (sliding-window layers) needs --disable-radix-cache: "
            "the sliding layers' windows live on the device per request, so a cached prefix has none")


def check(model_dir: str, page_size: int, disable_radix_cache: bool, offload: bool = True) -> None:
    """The checks that need only the checkpoint's config.json and the server arguments: the NosaConfig
    the backend will serve (nosa.serve.checkpoint.load_nosa_config), then, with ``offload``, the
    offloading settings."""
    from nosa.serve.checkpoint import load_nosa_config  # optional: torch (the plugin module imports none)

    cfg, _ = load_nosa_config(model_dir)
    if not offload:
        return
    OffloadSettings.from_env().validate(cfg, page_size)
    with open(os.path.join(model_dir, "config.json")) as f:
        data = json.load(f)
    text = data.get("text_config") or data
    check_hybrid_offload(text["num_hidden_layers"] - len(nosa_layers(text)), disable_radix_cache)


def startup_checks(server_args, previous) -> None:
    """Resolution-hook wrapper (``fn(server_args, previous)``): SGLang's step, then ``check`` where
    nosa serves a local checkpoint (the offloading checks where offloading is on)."""
    previous(server_args)
    from sglang.srt.arg_groups.overrides import (  # optional: sglang (the plugin module is imported without it)
        attention_backends_of,
        resolved_view,
        resolving_view,
    )

    if BACKEND_NAME not in attention_backends_of(resolved_view(server_args)):
        return
    cfg = resolving_view(server_args)
    if os.path.isfile(os.path.join(str(cfg.model_path), "config.json")):
        check(str(cfg.model_path), cfg.page_size, bool(cfg.disable_radix_cache), offload_enabled())


def install() -> None:
    """Register the hook once per process (the plugin's register() may run more than once)."""
    if _INSTALLED:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook  # optional: sglang

    register_resolution_hook(STEP)(startup_checks)
    _INSTALLED.append(True)
