"""Session fixtures: one embedded tiny checkpoint (written by rollplex.demo.tiny) and its processor."""

import pytest

from rollplex.demo.tiny import write_tiny
from rollplex.processor import VLProcessor


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="session")
def proc(tiny_dir):
    return VLProcessor.from_pretrained(tiny_dir)
