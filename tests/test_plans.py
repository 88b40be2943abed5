"""The plan table is the one table of contents of a migration: the docs show it as the code has it,
and every phase it names has code behind it."""

from __future__ import annotations

from pathlib import Path

import pytest

from podmigrate.engine import phases, plans
from podmigrate.engine.plans import PLANS, PhaseName
from podmigrate.k8s.phases import PHASES as K8S_PHASES

ROOT = Path(__file__).resolve().parents[1]


def between_markers(text: str) -> str:
    return text.split(plans.BEGIN, 1)[1].split(plans.END, 1)[0].strip()


@pytest.mark.parametrize("where", ["docs/architecture.md", "src/podmigrate/engine/plans.py"])
def test_the_documented_plan_table_is_the_one_in_the_code(where: str) -> None:
    text = (ROOT / where).read_text()
    assert between_markers(text) == plans.markdown_table(), (
        f"{where} shows another plan table: run `python -m podmigrate.engine.plans --write`"
    )


@pytest.mark.parametrize("key", list(PLANS), ids=lambda k: "/".join(k))
def test_every_phase_of_every_row_has_code_and_the_commit_is_one_of_them(key: tuple[str, str, str]) -> None:
    scope, mode, _ = key
    row = PLANS[key]
    impls = K8S_PHASES if scope == "kubernetes" else phases.implementations(scope, mode)
    assert [p for p in row.phases if p not in impls] == []
    assert row.phases[0] is PhaseName.VALIDATE and row.commit in row.phases
    assert len(set(row.phases)) == len(row.phases)


def test_after_the_commit_no_phase_needs_undoing() -> None:
    # once committed, failures finish forward: an undo there could never run, so none is declared
    for (scope, mode, _), row in PLANS.items():
        impls = K8S_PHASES if scope == "kubernetes" else phases.implementations(scope, mode)
        after = row.phases[row.phases.index(row.commit) + 1 :]
        assert [p for p in after if impls[p].undo] == [], (scope, mode)


def test_an_unknown_combination_says_what_was_asked() -> None:
    with pytest.raises(KeyError, match="no plan for scope 'container', mode 'lazy', transport 'registry'"):
        plans.row("container", "lazy", "registry")
