"""Shared test setup: the `cuda` marker skips without a device, and the tests
must run against the installed package, not the source folder."""

from __future__ import annotations

import os
import pathlib

import pytest

import mapoffload

SOURCE_ROOT = pathlib.Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"mapoffload from {pathlib.Path(mapoffload.__file__).parent}"


@pytest.fixture
def tmp_file_dir(tmp_path):
    """A temporary folder on a disk filesystem (not tmpfs), for file mappings."""
    return tmp_path


def drop_page_cache(path: str | os.PathLike) -> None:
    """Drop a file's clean pages (POSIX_FADV_DONTNEED) without root."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
