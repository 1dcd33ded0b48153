import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no Dynamo cache entries leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
