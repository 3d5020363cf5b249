"""A worker's KV settings are one section, `kv` (shared.kv.KVSettings): set by SPARSECAST_KV__*
(the flat SPARSECAST_KV_* names are deprecated aliases), taken by the engine as is, listed by --help."""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from services.rollout.core import RolloutCore, WeightState
from services.rollout.engine.config import KVConfig
from services.rollout.settings import FLAT_KV_NAMES, RolloutSettings, SyncSettings
from shared.kv import DEFAULT_KV_BUDGET, DEFAULT_KV_BUFFER, KVSettings
from shared.relay import PEER_CONGESTION
from shared.settings_help import settings_help, settings_rows

pytestmark = pytest.mark.usefixtures("clean_settings_env")


def test_nested_and_flat_names_set_the_budget(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shared.settings")
    monkeypatch.setenv("SPARSECAST_KV__BUDGET", "48")
    assert RolloutSettings().kv.budget == 48
    assert not caplog.records  # the nested name is not deprecated
    monkeypatch.delenv("SPARSECAST_KV__BUDGET")
    monkeypatch.setenv("SPARSECAST_KV_BUDGET", "48")
    assert RolloutSettings().kv.budget == 48
    assert [r.getMessage() for r in caplog.records] == [
        "SPARSECAST_KV_BUDGET is deprecated: set SPARSECAST_KV__BUDGET instead "
        "(the flat name will be removed)"
    ]
    assert RolloutSettings().kv.budget == 48 and len(caplog.records) == 1  # warned once


def test_every_flat_name_is_an_alias_and_the_nested_one_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    flat = {"SPARSECAST_KV_POLICY": "snapkv", "SPARSECAST_KV_BUDGET": "40", "SPARSECAST_KV_BUFFER": "4",
            "SPARSECAST_KV_KEEP_PROMPT": "false", "SPARSECAST_KV_LAYER_BUDGETS": "pyramid"}
    assert {f"SPARSECAST_{name}".upper() for name in FLAT_KV_NAMES} == set(flat)
    for name, value in flat.items():
        monkeypatch.setenv(name, value)
    assert RolloutSettings().kv == KVSettings(policy="snapkv", budget=40, buffer=4, keep_prompt=False,
                                              layer_budgets="pyramid")
    monkeypatch.setenv("SPARSECAST_KV__BUDGET", "64")
    monkeypatch.setenv("SPARSECAST_KV__PYRAMID_BETA", "8")
    kv = RolloutSettings().kv
    assert (kv.budget, kv.pyramid_beta, kv.policy) == (64, 8, "snapkv")
    # A given section wins over the environment, as any argument does.
    assert RolloutSettings(kv=KVSettings(budget=9)).kv == KVSettings(budget=9)


def test_flat_keywords_and_engine_fields_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="kv_budget: the kv settings are one section now"):
        RolloutSettings(kv_budget=48)  # type: ignore[call-arg]
    monkeypatch.setenv("SPARSECAST_KV__WINDOW", "4")  # an engine constant, not a worker setting
    with pytest.raises(ValidationError, match="kv.window"):
        RolloutSettings()
    monkeypatch.delenv("SPARSECAST_KV__WINDOW")
    monkeypatch.setenv("SPARSECAST_KV__BUDGET", "0")
    with pytest.raises(ValidationError, match="kv.budget"):
        RolloutSettings()


def test_one_default_for_the_budget() -> None:
    assert KVSettings().budget == DEFAULT_KV_BUDGET and KVSettings().buffer == DEFAULT_KV_BUFFER
    assert RolloutSettings().kv.budget == DEFAULT_KV_BUDGET
    assert RolloutSettings().kv == KVSettings()
    # The engine inherits the field, default included: it declares no budget of its own.
    assert KVConfig().budget == DEFAULT_KV_BUDGET and "budget" not in inspect.get_annotations(KVConfig)


def _old_kv_config(s: dict[str, Any], published: int | None, policy: str | None = None,
                   budget: int | None = None, **extra: Any) -> KVConfig:
    """RolloutCore.kv_config as it was, repacking the flat settings by hand."""
    policy = policy or s["kv_policy"]
    return KVConfig(
        policy=policy,
        budget=budget or published or s["kv_budget"],
        layer_budgets=extra.pop("layer_budgets", None) or (
            s["kv_layer_budgets"] if policy != "dense" else "uniform"),
        buffer=extra.pop("buffer", None) or s["kv_buffer"],
        keep_prompt=extra.pop("keep_prompt", s["kv_keep_prompt"]),
        **extra,
    )


CASES: list[tuple[KVSettings, int | None, dict[str, Any]]] = [
    (KVSettings(), None, {}),
    (KVSettings(policy="snapkv", budget=64, buffer=8, keep_prompt=False), 48, {}),
    (KVSettings(layer_budgets="pyramid", budget=64), None, {"policy": "dense"}),
    (KVSettings(layer_budgets="pyramid", budget=64), 40, {"budget": 32, "window": 4, "buffer": None}),
    (KVSettings(policy="dense"), None, {"policy": "h2o", "budget": 16, "keep_prompt": True}),
    (KVSettings(policy="streaming", buffer=3), 12, {"sink_tokens": 2, "layer_budgets": "pyramid"}),
]


@pytest.mark.parametrize(("section", "published", "request_values"), CASES)
def test_the_engine_takes_the_section_as_the_old_repacking_did(
    section: KVSettings, published: int | None, request_values: dict[str, Any]
) -> None:
    settings = RolloutSettings(kv=section)
    core = SimpleNamespace(engine=SimpleNamespace(name="native"), settings=settings,
                           weights=WeightState(kv_budget=published))
    flat = {f"kv_{name}": value for name, value in section.model_dump().items()}
    new = RolloutCore.kv_config(core, **request_values)  # type: ignore[arg-type]
    assert new == _old_kv_config(flat, published, **request_values)
    assert type(new) is KVConfig
    core.engine.name = "vllm"  # a dense-only engine runs dense whatever the section says
    assert RolloutCore.kv_config(core, **request_values) == KVConfig(policy="dense")  # type: ignore[arg-type]


def test_help_lists_the_kv_section() -> None:
    rows = {variable: default for variable, _, default, _ in settings_rows(RolloutSettings)}
    section = {name: default for name, default in rows.items() if name.startswith("SPARSECAST_KV")}
    assert section == {
        "SPARSECAST_KV__POLICY": "'rkv'", "SPARSECAST_KV__BUDGET": str(DEFAULT_KV_BUDGET),
        "SPARSECAST_KV__BUFFER": str(DEFAULT_KV_BUFFER), "SPARSECAST_KV__KEEP_PROMPT": "True",
        "SPARSECAST_KV__LAYER_BUDGETS": "'uniform'", "SPARSECAST_KV__PYRAMID_BETA": "20",
    }
    text = settings_help("python -m services.rollout", "A rollout worker.", RolloutSettings)
    assert "SPARSECAST_KV__BUDGET" in text and "tokens kept after each compression" in text


def test_the_sync_section_and_its_flat_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RolloutSettings().sync == SyncSettings(streams=4, bandwidth_mbps=None, poll_s=2.0, relay=False)
    flat = {"sync_streams", "sync_bandwidth_mbps", "sync_poll_s", "relay"}
    assert not flat & set(RolloutSettings.model_fields)
    monkeypatch.setenv("SPARSECAST_SYNC__POLL_S", "0.5")
    monkeypatch.setenv("SPARSECAST_SYNC_STREAMS", "8")  # deprecated, still read
    monkeypatch.setenv("SPARSECAST_SYNC_POLL_S", "9")  # the nested name wins
    assert RolloutSettings().sync == SyncSettings(streams=8, poll_s=0.5)
    with pytest.raises(ValidationError, match=r"relay: the sync settings are one section now"):
        RolloutSettings(relay=True)  # type: ignore[call-arg]
    rows = {variable for variable, _, _, _ in settings_rows(RolloutSettings)}
    assert {"SPARSECAST_SYNC__STREAMS", "SPARSECAST_SYNC__RELAY"} <= rows and "SPARSECAST_RELAY" not in rows


def test_the_peer_listeners_congestion_control(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RolloutSettings().sync.peer_congestion == PEER_CONGESTION == "cubic"
    monkeypatch.setenv("SPARSECAST_SYNC__PEER_CONGESTION", "")  # the host's default
    assert RolloutSettings().sync.peer_congestion == ""
    monkeypatch.setenv("SPARSECAST_SYNC__PEER_CONGESTION", "bbr")
    assert RolloutSettings().sync.peer_congestion == "bbr"
    for bad in ("cubic; reboot", "x" * 16, "BBR"):
        monkeypatch.setenv("SPARSECAST_SYNC__PEER_CONGESTION", bad)
        with pytest.raises(ValidationError, match="peer_congestion"):
            RolloutSettings()
