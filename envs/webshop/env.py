"""The WebShop environment: a world (catalog, search index, goals) and cheap episodes.

Actions follow upstream's text environment (``web_agent_text_env.py``): ``search[query]``
and ``click[target]``, the argument lower-cased; ``click`` works only on a current
clickable, never on the search button. One deliberate difference: upstream runs a search
from any page although only the start page shows a search bar; serl accepts ``search``
only where the bar is shown, so the admissible actions it lists are exactly the ones that
work. An invalid action leaves the page unchanged with reward 0 and is reported as
``error`` feedback with its reason. The episode ends on ``click[buy now]`` or, with
reward 0, at the turn limit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from envs.base import EnvError, Feedback, Step, state_key
from envs.webshop import authors, pages
from envs.webshop.catalog import DATA_ENV_VAR, Catalog, auto_synthetic_note, load_real_catalog
from envs.webshop.goals import SPLITS, build_goals, split_indices
from envs.webshop.pages import PageState
from envs.webshop.reward import total_reward
from envs.webshop.search import SearchEngine
from envs.webshop.synthetic import make_synthetic_catalog

DEFAULT_MAX_TURNS = 15
ACTION_RE = re.compile(r"(search|click)\[(.+)\]", re.DOTALL)

RULES = """You are shopping on WebShop, a simulated web store, to buy the product the instruction describes.
Each turn you see the current page: its visible texts separated by [SEP].
Act with exactly one action per turn:
- search[query]  type a query into the search bar (only on the page that shows a search bar)
- click[target]  click a button, a product's ASIN, or an option value shown on the page
The episode ends when you click[buy now]; your score is how well the product you bought,
its options and its price match the instruction."""


def load_catalog(
    kind: str = "auto", *, data_dir: str | None = None, synthetic_size: int = 200, synthetic_seed: int = 0
) -> Catalog:
    """``real`` (the 1k catalog), ``synthetic``, or ``auto``.

    ``auto`` takes the real catalog whenever a data folder is named (the argument or
    ``$SERL_DATA_DIR``) -- and then a folder without the files is an error, not a silent
    fallback -- and the synthetic catalog when none is.
    """
    if kind == "auto":
        kind = "real" if (data_dir or os.environ.get(DATA_ENV_VAR)) else "synthetic"
    if kind == "real":
        return load_real_catalog(data_dir)
    if kind == "synthetic":
        return make_synthetic_catalog(num_products=synthetic_size, seed=synthetic_seed)
    raise EnvError(f"unknown WebShop catalog {kind!r}: choose real, synthetic or auto")


@dataclass
class WebShopConfig:
    catalog: str = "auto"  # real | synthetic | auto (real where SERL_DATA_DIR is set)
    data_dir: str | None = None  # folder holding documents_1k.jsonl; default $SERL_DATA_DIR/webshop
    synthetic_size: int = 200
    synthetic_seed: int = 0
    max_turns: int = DEFAULT_MAX_TURNS


class WebShopWorld:
    """Shared read-only state: catalog, search engine, goals and their split."""

    name = "webshop"
    rules = RULES
    eval_split = "test"
    authors_prompt = authors.PROMPT  # prompt.style authors (envs.authors)

    def __init__(self, config: WebShopConfig | None = None, catalog: Catalog | None = None):
        self.config = config or WebShopConfig()
        self.catalog = catalog or load_catalog(
            self.config.catalog,
            data_dir=self.config.data_dir,
            synthetic_size=self.config.synthetic_size,
            synthetic_seed=self.config.synthetic_seed,
        )
        self.engine = SearchEngine(self.catalog.texts)
        self.goals, self.prices = build_goals(self.catalog)
        if not self.goals:
            raise EnvError(f"WebShop catalog {self.catalog.source} yields no goals (no product has an instruction)")
        self._search_cache: dict[str, list[int]] = {}
        self._expert_queries: dict[str, str] = {}
        self._index_of = {p["asin"]: i for i, p in enumerate(self.catalog.products)}

    def info(self) -> dict:
        """What a run records of this world's data: which catalog ran (real or synthetic) and its size."""
        return {"catalog": self.catalog.kind, "catalog_source": self.catalog.source, "products": len(self.catalog)}

    @property
    def notice(self) -> str | None:
        """A line for stderr where ``catalog: auto`` took the synthetic catalog (no data folder named)."""
        if self.config.catalog == "auto" and self.catalog.kind == "synthetic":
            return auto_synthetic_note(len(self.catalog))
        return None

    def splits(self) -> list[str]:
        return list(SPLITS)

    def num_tasks(self, split: str) -> int:
        return len(split_indices(len(self.goals), split))

    def goal(self, split: str, task_id: int) -> dict:
        idx = split_indices(len(self.goals), split)
        if not 0 <= task_id < len(idx):
            raise EnvError(f"task id {task_id} out of range: WebShop split {split!r} has tasks 0..{len(idx) - 1}")
        return self.goals[idx[task_id]]

    def search(self, query: str) -> list[int]:
        """Cached search: many rollouts of one task issue the same queries."""
        hits = self._search_cache.get(query)
        if hits is None:
            if len(self._search_cache) > 50_000:
                self._search_cache.clear()
            hits = self._search_cache[query] = self.engine.search(query)
        return hits

    def expert_query(self, goal: dict) -> str:
        """The expert's search: the instruction's words, or the product title when that misses the target."""
        key = goal["asin"] + "|" + goal["instruction_text"]
        if key not in self._expert_queries:
            base = self.catalog.instructions[goal["asin"]]["instruction"].lower()
            query = base if self._index_of[goal["asin"]] in self.search(base) else goal["name"].lower()
            self._expert_queries[key] = query
        return self._expert_queries[key]

    def corpus_texts(self) -> list[str]:
        """The catalog's own text, for training a tokenizer that reads these pages well."""
        return list(self.catalog.texts)

    def new_episode(self, split: str = "test", max_turns: int | None = None) -> WebShopEpisode:
        split_indices(len(self.goals), split)  # validate the split name early
        return WebShopEpisode(self, split, max_turns or self.config.max_turns)


class WebShopEpisode:
    def __init__(self, world: WebShopWorld, split: str, max_turns: int):
        self.world, self.split, self.max_turns = world, split, max_turns
        self.task_id = -1
        self.goal: dict = {}
        self.instruction = ""
        self.state = PageState()
        self.turns = 0
        self.done = True

    # -- protocol -------------------------------------------------------------------------
    def reset(self, task_id: int) -> Step:
        self.goal = self.world.goal(self.split, task_id)
        self.task_id, self.instruction = task_id, self.goal["instruction_text"]
        self.state, self.turns, self.done = PageState(), 0, False
        return self._step_result(0.0, Feedback(error=None, diff="page start"), {})

    def step(self, action: str) -> Step:
        if self.done:
            raise EnvError("the episode is over: reset it before stepping")
        before = self.state
        error = self._apply(action)
        self.turns += 1
        truncated = not self.done and self.turns >= self.max_turns
        if truncated:
            self.done = True
        diff = "no change" if error else pages.describe_change(before, self.state, self.world.catalog.products)
        reward = self.state.reward if self.state.page == "done" else 0.0
        return self._step_result(
            reward, Feedback(error=error, diff=diff), {"truncated": truncated, "invalid": error is not None}
        )

    # -- mechanics ------------------------------------------------------------------------
    def clickables(self) -> dict[str, tuple[str, str | None]]:
        return pages.clickables(self.state, self.world.catalog.products, self.world.catalog.by_asin)

    def admissible_actions(self) -> list[str]:
        if self.done:
            return []
        acts = ["search[<query>]"] if self.state.page == "start" else []
        return acts + [f"click[{c}]" for c in self.clickables() if c != "search"]

    def _apply(self, action: str) -> str | None:
        """Change the page for a valid action; return the reason when the action is invalid."""
        m = ACTION_RE.fullmatch(action.strip())
        if m is None:
            shown = action if len(action) <= 80 else action[:77] + "..."
            return f"unparseable action {shown!r}: expected search[query] or click[target]"
        verb, arg = m.group(1), m.group(2).strip().lower()
        return self._search(arg) if verb == "search" else self._click(arg)

    def _search(self, query: str) -> str | None:
        if self.state.page != "start":
            return "there is no search bar on this page: click[back to search] first"
        if not query:
            return "empty search query"
        self.state = PageState(page="results", query=query, hits=self.world.search(query))
        return None

    def _click(self, arg: str) -> str | None:
        targets = self.clickables()
        if arg == "search":
            return "click[search] does nothing: type a query with search[...]"
        if arg not in targets:
            return f"'{arg}' is not clickable on this page"
        kind, option_name = targets[arg]
        s = self.state.copy()
        if kind == "product":
            s.page, s.asin = "item", arg.upper()
        elif kind == "option":
            assert option_name is not None  # clickables names the option of every option value
            s.options[option_name] = arg
        elif arg == pages.BACK_TO_SEARCH:
            s = PageState()
        elif arg == pages.NEXT:
            s.results_page += 1
        elif arg == pages.PREV:
            if s.page == "results":
                s.results_page -= 1
            elif s.page == "item":
                s.page, s.asin, s.options = "results", None, {}  # back to the same results page
            else:
                s.page = "item"
        elif arg in pages.SUB_PAGES:
            s.page = arg
        elif arg == pages.BUY_NOW:
            asin = s.product_asin()
            product = self.world.catalog.by_asin[asin]
            s.page, s.reward = "done", total_reward(product, self.goal, self.world.prices[asin], s.options)
            self.done = True
        self.state = s
        return None

    def expert_action(self) -> str | None:
        """The reference action from the current state: search, open the target, pick the goal's options, buy."""
        s, goal = self.state, self.goal
        target = goal["asin"]
        if self.done:
            return None
        if s.page == "start":
            return f"search[{self.world.expert_query(goal)}]"
        if s.page == "results":
            products = self.world.catalog.products
            listed = [products[i]["asin"] for i in s.listed()]
            if target in listed:
                return f"click[{target.lower()}]"
            ranks = [products[i]["asin"] for i in s.hits]
            if target in ranks:
                wanted_page = ranks.index(target) // pages.PRODUCTS_PER_PAGE + 1
                return "click[next >]" if wanted_page > s.results_page else "click[< prev]"
            return "click[back to search]"
        if s.page == "item":
            if s.asin != target:
                return "click[< prev]"
            for name in sorted(goal["goal_options"]):
                if s.options.get(name) != goal["goal_options"][name]:
                    return f"click[{goal['goal_options'][name]}]"
            return "click[buy now]"
        return "click[< prev]"  # a sub-page: back to the item

    def _step_result(self, reward: float, feedback: Feedback, info: dict) -> Step:
        obs = pages.render(self.state, self.instruction, self.world.catalog.products, self.world.catalog.by_asin)
        info = {"page": self.state.page, "turn": self.turns, "won": self.done and reward >= 1.0, **info}
        return Step(
            observation=obs,
            reward=float(reward),
            done=self.done,
            feedback=feedback,
            admissible_actions=self.admissible_actions(),
            state_key=state_key(obs),
            expert_action=self.expert_action(),
            info=info,
        )
