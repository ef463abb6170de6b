"""Folders named by environment variables are absolute: a relative one would name another folder in
each process's current directory. ``MAPOFFLOAD_PEERS_DIR`` relative is refused (processes started from
different folders never saw each other's records: their page-cache plans ignored each other, silently);
a relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec says (conversions went under the current
folder)."""

from __future__ import annotations

import os

import pytest

from mapoffload._env import EnvSettingError
from mapoffload.conversion.naming import default_root
from mapoffload.pagecache.peers import ENV_PEERS_DIR, PeerRegistry


def test_a_relative_peers_folder_is_refused_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV_PEERS_DIR, "relative/peers")
    with pytest.raises(EnvSettingError, match="MAPOFFLOAD_PEERS_DIR.*absolute"):
        PeerRegistry()
    assert os.listdir(tmp_path) == []  # nothing made


def test_an_absolute_or_home_peers_folder_is_taken(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_PEERS_DIR, str(tmp_path / "peers"))
    assert PeerRegistry().folder.startswith(str(tmp_path / "peers") + os.sep)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(ENV_PEERS_DIR, "~/p")
    assert PeerRegistry().folder.startswith(str(tmp_path / "p") + os.sep)


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / ".mapoffload-converted").write_text("someone's file")  # stepped around: the user's cache
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MAPOFFLOAD_CONVERT_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relcache")
    assert default_root(str(checkpoint)) == str(tmp_path / "home" / ".cache" / "mapoffload" / "converted")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root(str(checkpoint)) == str(tmp_path / "xdg" / "mapoffload" / "converted")
