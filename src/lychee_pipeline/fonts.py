"""Chinese text in matplotlib figures: a CJK font as fallback when one is installed.

matplotlib draws Chinese titles as boxes unless one of its fonts has the glyphs, and it is never told about
an installed CJK font by itself. `use_cjk_fallback()` appends the first installed CJK font to the sans-serif
list (matplotlib >= 3.6 falls back glyph by glyph), so Latin text keeps its font. On Debian/Ubuntu the fonts
come with `apt-get install fonts-noto-cjk` (Noto Sans CJK); WenQuanYi and Source Han fonts are found too.
"""

from __future__ import annotations

CJK_FONT_NAMES = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK TC", "Noto Sans CJK KR",
                  "Noto Sans SC", "Source Han Sans SC", "Source Han Sans CN", "WenQuanYi Zen Hei",
                  "WenQuanYi Micro Hei", "Droid Sans Fallback", "AR PL UMing CN", "SimHei", "Microsoft YaHei",
                  "PingFang SC", "Hiragino Sans GB")
DEBIAN_PACKAGE = "fonts-noto-cjk"


def installed_cjk_font(names: tuple[str, ...] = CJK_FONT_NAMES) -> str | None:
    """The first CJK font matplotlib knows of, by family name (None when there is none)."""
    from matplotlib import font_manager

    available = {f.name for f in font_manager.fontManager.ttflist}
    return next((n for n in names if n in available), None)


def use_cjk_fallback() -> str | None:
    """Add the installed CJK font as a fallback of matplotlib's sans-serif family; return its name or None."""
    import matplotlib

    font = installed_cjk_font()
    if font is None:
        return None
    families = [f for f in matplotlib.rcParams["font.sans-serif"] if f != font]
    matplotlib.rcParams["font.sans-serif"] = families + [font]
    if "sans-serif" not in matplotlib.rcParams["font.family"]:
        matplotlib.rcParams["font.family"] = list(matplotlib.rcParams["font.family"]) + ["sans-serif"]
    return font
