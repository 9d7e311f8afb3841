import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter. It must be chosen before triton is
    # first imported (transformers imports it), so here rather than in the kernel tests.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def legacy_copy():
    """f(ckpt, dest) -> dest: the checkpoint as written before the NOSA model types (model_type
    llama / qwen2 / qwen3 with a 'nosa' section, no auto_map, no modeling_nosa.py). Files other than
    config.json are symlinked."""
    from nosa import checkpoint_format

    def make(ckpt, dest):
        dest = str(dest)
        os.makedirs(dest)
        for name in os.listdir(ckpt):
            if name not in ("config.json", checkpoint_format.CODE_FILE):
                os.symlink(os.path.join(os.path.abspath(ckpt), name), os.path.join(dest, name))
        with open(os.path.join(ckpt, "config.json")) as f:
            config = json.load(f)
        nosa_type = checkpoint_format.BY_NAME[config.pop("model_type")]
        config.pop("auto_map")
        config.update(model_type=nosa_type.base, architectures=[nosa_type.base_architecture])
        with open(os.path.join(dest, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        return dest

    return make
