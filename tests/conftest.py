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


# scripts/test.sh runs the suite on two pytest-xdist workers, which take a whole group of tests at a
# time (``pytest_xdist_make_scheduler`` below). A group is one file (its module-scoped servers start
# once), except:
# - the modules that start several SGLang servers at once are one group, run in the order below on
#   one worker, so that no two of them hold their servers at the same time (about half a GB of RAM
#   per SGLang process, a dozen processes per module); the session's shared servers
#   (tests/serve/conftest.py) are theirs;
# - tests/real is one group (one model download, one dense model), except its Gemma 3 tests, which
#   are a group of their own (another model: they run beside the SmolLM2 ones).
# Groups run longest first, so that the two workers end together.
MANY_SERVERS = ("serve/test_parallel.py", "serve/test_cpu_graphs.py", "serve/test_validation.py",
                "serve/test_sglang_backend.py", "serve/test_offload.py")
LONGEST_FIRST = ("many-servers", "real", "real/test_gemma3.py", "serve/test_hybrid.py",
                 "serve/test_decode_graph.py", "serve/test_soak.py",
                 "serve/test_serve_ask.py", "serve/test_trained_checkpoint.py", "serve/test_engine.py",
                 "test_kernels_aot.py", "test_attention.py", "test_load.py", "test_locality.py")


def group_of(path: str) -> str:
    """The group of a test file, ``path`` relative to tests/."""
    if path in MANY_SERVERS:
        return "many-servers"
    if path == "real/test_gemma3.py":
        return path
    return "real" if path.startswith("real/") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with our groups as the scopes, in collection order (sorted below)."""
    from xdist.scheduler import LoadScopeScheduling  # optional: pytest-xdist (only xdist calls this hook)

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::")[0].removeprefix("tests/"))

    config.option.loadscopereorder = False  # the order of the collection, not by test count
    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    tests = os.path.dirname(os.path.abspath(__file__))
    paths = {id(item): os.path.relpath(str(item.path), tests) for item in items}
    group_rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    file_rank = {name: i for i, name in enumerate(MANY_SERVERS)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (group_rank.get(group_of(paths[id(item)]), len(group_rank)),
                                 file_rank.get(paths[id(item)], 0), order[id(item)]))
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
