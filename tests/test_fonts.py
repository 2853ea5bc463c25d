"""The notebook's CJK font fallback: used when a CJK font is installed, a clear None (and package) when not."""

from __future__ import annotations

import matplotlib
import pytest
from matplotlib import font_manager

from lychee_pipeline.fonts import DEBIAN_PACKAGE, installed_cjk_font, use_cjk_fallback


@pytest.fixture
def fonts(monkeypatch):
    monkeypatch.setattr(font_manager.fontManager, "ttflist", list(font_manager.fontManager.ttflist))
    with matplotlib.rc_context():
        yield font_manager.fontManager.ttflist


def test_no_cjk_font_changes_nothing(fonts):
    fonts[:] = [f for f in fonts if "CJK" not in f.name and "WenQuanYi" not in f.name]
    before = list(matplotlib.rcParams["font.sans-serif"])
    assert installed_cjk_font() is None and use_cjk_fallback() is None
    assert matplotlib.rcParams["font.sans-serif"] == before
    assert DEBIAN_PACKAGE == "fonts-noto-cjk"


def test_an_installed_cjk_font_becomes_the_fallback(fonts):
    dejavu = next(f for f in fonts if f.name == "DejaVu Sans")
    fonts.append(font_manager.FontEntry(fname=dejavu.fname, name="Noto Sans CJK JP"))
    assert use_cjk_fallback() == "Noto Sans CJK JP"
    families = matplotlib.rcParams["font.sans-serif"]
    assert families[-1] == "Noto Sans CJK JP" and families[0] != "Noto Sans CJK JP"  # Latin text keeps its font
    assert "sans-serif" in matplotlib.rcParams["font.family"]
