"""WebShop product catalogs: the real 1k catalog on disk, or a synthetic one serl generates.

Both give the same thing: the processed product dicts of upstream's ``load_products``
(keys ``asin``, ``name``, ``Title``, ``Description``, ``BulletPoints``, ``Attributes``,
``options``, ``pricing``, ``Price``, ``Rating``, ``Reviews``, ``query``, ``category``,
``product_category``), the text BM25 indexes for each, and the synthetic instructions of
``items_ins_v2_1000.json`` (``instruction``, ``instruction_attributes``) by ASIN.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from envs.base import EnvError

DATA_ENV_VAR = "SERL_DATA_DIR"
DOCUMENTS_FILE = "documents_1k.jsonl"
INSTRUCTIONS_FILE = "items_ins_v2_1000.json"


@dataclass
class Catalog:
    products: list[dict]  # processed product dicts in document (docid) order
    texts: list[str]  # the text BM25 indexes, one per product
    instructions: dict[str, dict]  # asin -> {"attributes", "instruction"?, "instruction_attributes"?}
    source: str  # "webshop-1k:<dir>" or "synthetic:n=<n>,seed=<seed>"

    def __post_init__(self) -> None:
        self.by_asin = {p["asin"]: p for p in self.products}

    def __len__(self) -> int:
        return len(self.products)

    @property
    def kind(self) -> str:
        """``real`` (the benchmark's 1k catalog) or ``synthetic`` (serl's generated one): what runs record."""
        return "real" if self.source.startswith("webshop-1k:") else "synthetic"


def auto_synthetic_note(products: int) -> str:
    """The one line ``catalog: auto`` prints when no data folder is named and it takes the synthetic catalog."""
    return (
        f"{DATA_ENV_VAR} is not set, so WebShop runs on serl's synthetic catalog ({products} products), not the "
        f"benchmark's 1k catalog: export {DATA_ENV_VAR}=<the folder holding webshop/{DOCUMENTS_FILE}> for the "
        "benchmark, or set env.settings.catalog=synthetic to choose it"
    )


def document_text(product: dict) -> str:
    """The per-product text upstream indexed: title, description, first bullet, options, lower-cased.

    Mirrors ``search_engine/convert_product_file_format.py`` of princeton-nlp/WebShop.
    """
    option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product.get("options", {}).items())
    bullets = product.get("BulletPoints") or [""]
    return " ".join([product["Title"], product["Description"], bullets[0], option_text]).lower()


def webshop_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Where the real catalog lives: the argument, else ``$SERL_DATA_DIR/webshop``."""
    if data_dir is None:
        root = os.environ.get(DATA_ENV_VAR)
        if not root:
            raise EnvError(
                f"{DATA_ENV_VAR} is not set: the real WebShop catalog must be at ${DATA_ENV_VAR}/webshop/"
                f"{DOCUMENTS_FILE} (with {INSTRUCTIONS_FILE} beside it), or use catalog=synthetic"
            )
        data_dir = Path(root) / "webshop"
    path = Path(data_dir)
    for name in (DOCUMENTS_FILE, INSTRUCTIONS_FILE):
        if not (path / name).is_file():
            raise EnvError(
                f"WebShop data not found: {path / name} is missing (set {DATA_ENV_VAR} to the folder holding webshop/)"
            )
    return path


def load_real_catalog(data_dir: str | os.PathLike | None = None) -> Catalog:
    path = webshop_data_dir(data_dir)
    products, texts = [], []
    with open(path / DOCUMENTS_FILE, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                doc = json.loads(line)
                products.append(doc["product"])
                texts.append(doc["contents"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise EnvError(
                    f"{path / DOCUMENTS_FILE}:{lineno}: not a WebShop document record ({e.__class__.__name__})"
                ) from None
    try:
        with open(path / INSTRUCTIONS_FILE, encoding="utf-8") as f:
            instructions = json.load(f)
    except json.JSONDecodeError as e:
        raise EnvError(f"{path / INSTRUCTIONS_FILE}: malformed JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(instructions, dict):
        raise EnvError(f"{path / INSTRUCTIONS_FILE}: expected a JSON object keyed by ASIN")
    return Catalog(products=products, texts=texts, instructions=instructions, source=f"webshop-1k:{path}")
