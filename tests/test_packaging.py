"""Packaging: one version string, TensorFlow and the data sets as extras, py.typed."""

import configparser
import importlib.metadata
import os

import pytest

import tfdist_ext
from conftest import REPO
from tests.programs import run_program


def _setup_cfg():
    from setuptools.config.setupcfg import read_configuration

    return read_configuration(os.path.join(REPO, "setup.cfg"))


def test_setup_cfg_takes_the_version_from_the_package():
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    assert config["metadata"]["version"] == "attr: tfdist_ext.__version__"  # not a second copy
    assert _setup_cfg()["metadata"]["version"] == tfdist_ext.__version__


def test_version_is_the_installed_distributions():
    try:
        installed = importlib.metadata.version("tfdist_ext")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tfdist_ext is not installed in this environment (tox installs it)")
    assert tfdist_ext.__version__ == installed


def test_tensorflow_is_an_extra_and_the_tested_versions_are_bounded():
    options = _setup_cfg()["options"]
    assert not [r for r in options["install_requires"] if r.startswith("tensorflow")]
    assert "keras>=3.12.0,<3.16" in options["install_requires"]
    # Extra names are compared normalized (PEP 685): and-cuda == and_cuda.
    extras = {k.replace("_", "-"): v for k, v in options["extras_require"].items()}
    assert extras["cpu"][0].startswith("tensorflow-cpu>=2.21,<2.22;")
    assert extras["and-cuda"] == ["tensorflow[and-cuda]>=2.21,<2.22"]
    assert extras["tensorflow"] == ["tensorflow>=2.21,<2.22"]
    assert set(extras["data"]) == {"scikit-learn", "mnist1d"}


def test_py_typed_is_shipped():
    assert os.path.isfile(os.path.join(os.path.dirname(tfdist_ext.__file__), "py.typed"))
    assert "py.typed" in _setup_cfg()["options"]["package_data"]["tfdist_ext"]


def test_import_without_tensorflow_names_the_extras():
    message = run_program("packaging_cases", "without_tensorflow", timeout=60)["import_error"]
    assert "needs TensorFlow 2.21" in message
    for extra in ("tfdist_ext[cpu]", "tfdist_ext[and-cuda]", "tfdist_ext[tensorflow]"):
        assert extra in message


@pytest.mark.parametrize(
    "blocked, call, extra",
    [
        # call: a data set call of tests/programs/packaging_cases.py's CALLS.
        ("sklearn", "digits", "tfdist_ext[data]"),
        ("mnist1d", "mnist1d", "tfdist_ext[data]"),
        ("tensorflow_datasets", "from_tfds", "tfdist_ext[tfds]"),
    ],
)
def test_a_data_set_without_its_extra_names_the_extra(blocked, call, extra):
    message = run_program("packaging_cases", "data_set_without", blocked, call, timeout=120)[
        "import_error"
    ]
    assert f"'{blocked}' package" in message
    assert f"pip install '{extra}'" in message
