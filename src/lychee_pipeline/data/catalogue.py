"""A synthetic e-commerce catalogue, generated deterministically by seed (Kedro-free).

Products are category x colour x material x style. Each has a 64x64 PNG drawn with Pillow
(shape = category, fill = colour, texture = material, background = style) and a bilingual
title, so relevance can be learned from the text and from the pixels. Popularity follows a
Zipf law over a random ranking and is written to each document's ``meta`` with click and
purchase proxies. Queries are English or Chinese text, an image, or an image with text.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

MARKER = ".lychee-demo.json"
GENERATOR_VERSION = 1
RECORDS_FILE = "records.jsonl"
IMAGES_DIR = "images"

# name, Chinese name, shape
CATEGORIES = [
    ("dress", "连衣裙", "triangle"),
    ("shirt", "衬衫", "tee"),
    ("shoes", "鞋子", "ellipse"),
    ("bag", "包", "bag"),
    ("hat", "帽子", "dome"),
    ("cup", "杯子", "cup"),
    ("lamp", "台灯", "trapezoid"),
    ("chair", "椅子", "chair"),
]
COLOURS = [
    ("red", "红色", (210, 40, 40)),
    ("blue", "蓝色", (40, 70, 210)),
    ("green", "绿色", (40, 160, 60)),
    ("yellow", "黄色", (235, 210, 40)),
    ("black", "黑色", (20, 20, 20)),
    ("white", "白色", (245, 245, 245)),
    ("purple", "紫色", (130, 50, 170)),
    ("orange", "橙色", (240, 130, 30)),
]
MATERIALS = [("cotton", "棉", "plain"), ("leather", "皮革", "dots"), ("silk", "丝绸", "stripes"),
             ("wool", "羊毛", "grid"), ("denim", "牛仔", "diagonal")]
STYLES = [("casual", "休闲", (170, 170, 170)), ("formal", "正式", (135, 135, 160)),
          ("sporty", "运动", (155, 180, 155)), ("vintage", "复古", (185, 165, 135))]

EN_TEMPLATES = ["{colour} {material} {category}", "{style} {colour} {category} made of {material}",
                "looking for a {colour} {category} in {material}", "{colour} {category}"]
ZH_TEMPLATES = ["{colour}{material}{category}", "想买{style}风格的{colour}{category}，{material}材质",
                "{colour}的{category}", "推荐一款{colour}{material}{category}"]
IT_TEMPLATES = ["a {category} like this one but {colour}", "同款{colour}{category}"]


@dataclass(frozen=True)
class Product:
    """One catalogue product and its attributes (indices into the attribute tables)."""

    product_id: str
    category: int
    colour: int
    material: int
    style: int
    popularity: float
    clicks: int
    purchased: int

    @property
    def image(self) -> str:
        return f"{IMAGES_DIR}/{self.product_id}.png"

    def words(self, zh: bool = False) -> dict[str, str]:
        i = 1 if zh else 0
        return {"category": CATEGORIES[self.category][i], "colour": COLOURS[self.colour][i],
                "material": MATERIALS[self.material][i], "style": STYLES[self.style][i]}

    def text(self) -> str:
        en, zh = self.words(), self.words(zh=True)
        return (f"{en['style'].capitalize()} {en['colour']} {en['material']} {en['category']}. "
                f"A {en['style']} {en['category']} made of {en['material']} in {en['colour']}. "
                f"{zh['style']}{zh['colour']}{zh['material']}{zh['category']}")

    def meta(self) -> dict[str, Any]:
        return {"popularity": self.popularity, "clicks": self.clicks, "purchased": self.purchased,
                "category": CATEGORIES[self.category][0]}


def default_params() -> dict[str, Any]:
    """The default generation parameters (also in conf/base/parameters_demo_data.yml)."""
    return {"out_dir": "data/01_raw/demo", "seed": 42, "n_products": 320, "n_records": 2400,
            "zipf_exponent": 1.1, "n_hard_negatives": 4, "n_random_negatives": 3,
            "query_mix": {"en": 0.5, "zh": 0.3, "image": 0.1, "image_text": 0.1},
            "doc_mix": {"image_text": 0.7, "text": 0.15, "image": 0.15}}


def make_products(params: dict[str, Any]) -> list[Product]:
    """Sample ``n_products`` attribute combinations and give them Zipf popularity."""
    rng = random.Random(params["seed"])
    combos = [(c, k, m, s) for c in range(len(CATEGORIES)) for k in range(len(COLOURS))
              for m in range(len(MATERIALS)) for s in range(len(STYLES))]
    n = min(int(params["n_products"]), len(combos))
    chosen = rng.sample(combos, n)
    ranks = list(range(n))
    rng.shuffle(ranks)
    weights = [1.0 / (r + 1) ** float(params["zipf_exponent"]) for r in ranks]
    total = sum(weights)
    products = []
    for i, ((c, k, m, s), w) in enumerate(zip(chosen, weights)):
        popularity = w / total
        clicks = int(round(200000 * popularity)) + rng.randint(0, 5)
        purchased = int(clicks * rng.uniform(0.02, 0.08))
        products.append(Product(f"p{i:05d}", c, k, m, s, round(popularity, 8), clicks, purchased))
    return products


def _shape(draw: ImageDraw.ImageDraw, shape: str, fill: int) -> None:
    if shape == "triangle":
        draw.polygon([(32, 6), (8, 58), (56, 58)], fill=fill)
    elif shape == "tee":
        draw.polygon([(18, 8), (46, 8), (60, 22), (50, 28), (46, 24), (46, 58), (18, 58), (18, 24),
                      (14, 28), (4, 22)], fill=fill)
    elif shape == "ellipse":
        draw.ellipse((4, 22, 60, 46), fill=fill)
    elif shape == "bag":
        draw.rectangle((12, 24, 52, 58), fill=fill)
        draw.arc((20, 8, 44, 36), 180, 360, fill=fill, width=4)
    elif shape == "dome":
        draw.pieslice((12, 14, 52, 54), 180, 360, fill=fill)
        draw.rectangle((4, 34, 60, 40), fill=fill)
    elif shape == "cup":
        draw.rectangle((16, 12, 42, 56), fill=fill)
        draw.ellipse((38, 22, 56, 44), outline=fill, width=4)
    elif shape == "trapezoid":
        draw.polygon([(22, 6), (42, 6), (56, 36), (8, 36)], fill=fill)
        draw.rectangle((30, 36, 34, 54), fill=fill)
        draw.rectangle((18, 54, 46, 58), fill=fill)
    elif shape == "chair":
        draw.polygon([(14, 4), (22, 4), (22, 34), (50, 34), (50, 60), (44, 60), (44, 42), (20, 42),
                      (20, 60), (14, 60)], fill=fill)
    else:  # pragma: no cover - the tables above are closed
        raise ValueError(shape)


def _texture(draw: ImageDraw.ImageDraw, pattern: str, colour: tuple[int, int, int]) -> None:
    if pattern == "dots":
        for x in range(2, 64, 7):
            for y in range(2, 64, 7):
                draw.ellipse((x, y, x + 3, y + 3), fill=colour)
    elif pattern == "stripes":
        for y in range(0, 64, 6):
            draw.line((0, y, 63, y), fill=colour, width=2)
    elif pattern == "grid":
        for v in range(0, 64, 8):
            draw.line((v, 0, v, 63), fill=colour)
            draw.line((0, v, 63, v), fill=colour)
    elif pattern == "diagonal":
        for v in range(-64, 64, 8):
            draw.line((v, 0, v + 63, 63), fill=colour, width=2)


def draw_product(product: Product) -> Image.Image:
    """The product's 64x64 RGB picture: shape by category, fill by colour, texture by material."""
    fill = COLOURS[product.colour][2]
    image = Image.new("RGB", (64, 64), STYLES[product.style][2])
    layer = Image.new("RGB", (64, 64), fill)
    tex = (90, 90, 90) if max(fill) < 60 else tuple(int(v * 0.55) for v in fill)
    _texture(ImageDraw.Draw(layer), MATERIALS[product.material][2], tex)
    mask = Image.new("L", (64, 64), 0)
    _shape(ImageDraw.Draw(mask), CATEGORIES[product.category][2], 255)
    image.paste(layer, (0, 0), mask)
    return image


def _pick(rng: random.Random, mix: dict[str, float]) -> str:
    keys = list(mix)
    return rng.choices(keys, weights=[float(mix[k]) for k in keys])[0]


def _doc(product: Product, mode: str, hard: bool | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": product.product_id}
    if mode in ("image_text", "text"):
        doc["text"] = product.text()
    if mode in ("image_text", "image"):
        doc["image"] = product.image
    doc["meta"] = product.meta()
    if hard is not None:
        doc["hard"] = hard
    return doc


def make_records(products: list[Product], params: dict[str, Any]) -> list[dict[str, Any]]:
    """Raw records: a query drawn by popularity, its product as positive, hard and random negatives."""
    rng = random.Random(params["seed"] + 1)
    weights = [p.popularity for p in products]
    records = []
    for _ in range(int(params["n_records"])):
        pos = rng.choices(products, weights=weights)[0]
        kind = _pick(rng, params["query_mix"])
        if kind == "en":
            query: Any = rng.choice(EN_TEMPLATES).format(**pos.words())
        elif kind == "zh":
            query = rng.choice(ZH_TEMPLATES).format(**pos.words(zh=True))
        elif kind == "image":
            query = {"image": pos.image}
        else:
            words = pos.words(zh=rng.random() < 0.5)
            template = IT_TEMPLATES[1] if any("\u4e00" <= ch <= "\u9fff" for ch in words["colour"]) else IT_TEMPLATES[0]
            query = {"text": template.format(**words), "image": pos.image}
        other_colour = [p for p in products if p.category == pos.category and p.colour != pos.colour]
        other_category = [p for p in products if p.colour == pos.colour and p.category != pos.category]
        n_hard = int(params["n_hard_negatives"])
        hard = rng.sample(other_colour, min(len(other_colour), (n_hard + 1) // 2))
        hard += rng.sample(other_category, min(len(other_category), n_hard - len(hard)))
        taken = {p.product_id for p in hard} | {pos.product_id}
        pool = [p for p in products if p.product_id not in taken
                and not (p.category == pos.category and p.colour == pos.colour)]
        randoms = rng.sample(pool, min(len(pool), int(params["n_random_negatives"])))
        mode = _pick(rng, params["doc_mix"])
        if kind == "image" and mode == "image":
            mode = "image_text"  # an identical picture as the only signal would be a copy test
        records.append({
            "query": query,
            "pos_doc": _doc(pos, mode),
            "neg_docs": [_doc(p, mode, True) for p in hard] + [_doc(p, mode, False) for p in randoms],
        })
    return records


def _fingerprint(params: dict[str, Any]) -> dict[str, Any]:
    keep = {k: v for k, v in params.items() if k != "out_dir"}
    return json.loads(json.dumps({"version": GENERATOR_VERSION, **keep}, sort_keys=True))


def ensure_demo_data(params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate the demo catalogue into ``out_dir`` unless its marker says it is already there.

    Writes only inside ``out_dir`` and refuses a non-empty folder without this generator's marker.
    """
    params = {**default_params(), **(params or {})}
    out = Path(params["out_dir"]).expanduser().resolve()
    marker = out / MARKER
    fingerprint = _fingerprint(params)
    summary = {"files": [str(out / RECORDS_FILE)], "image_roots": [str(out)]}
    if marker.exists():
        state = json.loads(marker.read_text(encoding="utf-8"))
        if state.get("complete") and state.get("params") == fingerprint and (out / RECORDS_FILE).exists():
            return {**summary, "records": state["records"], "images": state["images"], "generated": False}
    elif out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty and has no {MARKER}: refusing to write demo data there")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"complete": False, "params": fingerprint}), encoding="utf-8")
    if (out / IMAGES_DIR).exists():
        shutil.rmtree(out / IMAGES_DIR)
    (out / IMAGES_DIR).mkdir()
    products = make_products(params)
    for product in products:
        draw_product(product).save(out / product.image, format="PNG")
    records = make_records(products, params)
    with (out / RECORDS_FILE).open("w", encoding="utf-8", newline="\n") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    state = {"complete": True, "params": fingerprint, "records": len(records), "images": len(products)}
    marker.write_text(json.dumps(state, sort_keys=True), encoding="utf-8")
    return {**summary, "records": len(records), "images": len(products), "generated": True}
