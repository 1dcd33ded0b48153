"""The mutation script's mutants stay meaningful as the code moves (the script itself runs outside CI: 45
minutes): each one's text occurs once, the patched file still compiles (a syntax error would be "killed" by any
import, found in stop 33), a mutant changes something, names are unique, and every test file it runs exists."""
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mutants_module():
    spec = importlib.util.spec_from_file_location("burstc_mutants", ROOT / "benchmarks" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


MUTANTS = _mutants_module()


@pytest.mark.parametrize("mutant", MUTANTS.MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_once_and_compiles(mutant):
    source = (ROOT / mutant.path).read_text()
    patched = mutant.patched(source)  # raises unless its text occurs exactly once
    assert patched != source and mutant.old != mutant.new
    assert MUTANTS.syntax_error(patched, mutant.path) == ""
    assert mutant.tests and all((ROOT / args[0]).is_file() for args in mutant.tests)


def test_names_are_unique_and_a_broken_mutant_is_reported_not_killed():
    names = [m.name for m in MUTANTS.MUTANTS]
    assert len(names) == len(set(names)) >= 30
    assert "does not compile" in MUTANTS.syntax_error("if True:\n    # nothing left\n", "x.py")
