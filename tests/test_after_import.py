"""nosa.after_import on a throw-away package shaped like transformers' import chain:
``pkg.model`` -> ``pkg.layers`` -> ``pkg.auto``, where ``pkg.layers`` needs ``pkg.auto`` whole."""

import sys

import pytest

from nosa.after_import import when_imported

FILES = {
    "__init__.py": "",
    "model.py": "import pkg.layers\nREADY = True\n",
    "layers.py": "from pkg.auto import Registry\n",
    "auto.py": "class Registry:\n    names = []\n",
}


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    for name, text in FILES.items():
        (tmp_path / "pkg" / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m == "pkg" or m.startswith("pkg.")]:
        del sys.modules[name]
    assert not [f for f in sys.meta_path if getattr(f, "quiet", None) == "pkg"]  # the finder left when done


def register():
    """Like nosa's registration: needs pkg.model complete, which is half-imported while pkg.auto loads."""
    import pkg.auto
    import pkg.model

    pkg.auto.Registry.names.append(pkg.model.READY)


def test_callback_waits_for_the_chain_that_imported_its_module(pkg):
    when_imported("pkg.auto", register, quiet="pkg")
    # pkg.model -> pkg.layers -> pkg.auto: the callback runs once pkg.model is done
    import pkg.model  # noqa: F401

    assert sys.modules["pkg.auto"].Registry.names == [True]
    import pkg.layers  # noqa: F401  (already imported: nothing runs twice)

    assert sys.modules["pkg.auto"].Registry.names == [True]


def test_module_already_imported_runs_at_once(pkg):
    import pkg.model

    calls = []
    when_imported("pkg.auto", lambda: calls.append(pkg.model.READY), quiet="pkg")
    assert calls == [True]


def test_module_must_belong_to_the_quiet_package():
    with pytest.raises(ValueError, match="'pkgx.auto' is not a module of 'pkg'"):
        when_imported("pkgx.auto", register, quiet="pkg")
