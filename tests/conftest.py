"""Session fixtures: one embedded tiny checkpoint (written by rollplex.tiny) and its processor."""

import pytest

from rollplex.processor import VLProcessor
from rollplex.tiny import write_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="session")
def proc(tiny_dir):
    return VLProcessor.from_pretrained(tiny_dir)
