"""Serving configuration without a cluster: the deploy/ files against Ray's own schema, ServeConfig
validation, the Serve options a config turns into, and the autoscaling policy's arithmetic."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from specserve.config import SpeculativeConfig
from specserve.default_drafter import default_speculative
from specserve.serve.autoscaling import EngineLoadPolicy, LoadReport, engine_load_policy, replicas_needed
from specserve.serve.config import ServeConfig
from specserve.serve.placement import engine_deployment_options

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
FILES = sorted(DEPLOY.glob("*.yaml"))


def test_every_deploy_file_is_there():
    assert {f.name for f in FILES} >= {"local.yaml", "gpu.yaml", "tp2.yaml", "autoscale.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_deploy_files_are_valid_serve_configs(path):
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)  # what `serve deploy` checks
    (app,) = schema.applications
    assert app.import_path == "specserve.serve:build_app"
    config = ServeConfig.model_validate(app.args)
    from specserve.serve.app import build_app

    built = build_app(app.args)  # the builder accepts the file's args as they are
    assert type(built).__name__ == "Application"
    options = engine_deployment_options(config, gpu=config.device == "cuda")
    assert len(options["placement_group_bundles"]) == config.tp_size
    assert options["placement_group_strategy"] == "STRICT_PACK"


def test_tp2_file_asks_one_gpu_per_rank():
    args = yaml.safe_load((DEPLOY / "tp2.yaml").read_text())["applications"][0]["args"]
    options = engine_deployment_options(ServeConfig.model_validate(args), gpu=True)
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1}, {"CPU": 1.0, "GPU": 1}]
    assert options["ray_actor_options"]["num_gpus"] == 1


def test_autoscale_file_plugs_in_the_engine_load_policy():
    args = yaml.safe_load((DEPLOY / "autoscale.yaml").read_text())["applications"][0]["args"]
    options = engine_deployment_options(ServeConfig.model_validate(args), gpu=False)
    policy = options["autoscaling_config"]["policy"]
    assert policy["policy_function"] == "specserve.serve.autoscaling:EngineLoadPolicy"
    assert "num_replicas" not in options
    # Serve hands policy_kwargs to the class's constructor only: the file's targets must reach it.
    run = EngineLoadPolicy(**policy["policy_kwargs"])
    queued = LoadReport(running=8, waiting=9, kv_usage=0.2, ttft_s=0.1)
    assert run(_ctx(1, 17, _per_replica(queued)))[0] == 2  # 9 waiting / target_queue_depth 8
    assert engine_load_policy(_ctx(1, 17, _per_replica(queued)))[0] == 3  # the defaults' answer


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"port": 70000}, "port"),
        ({"page_size": 0}, "page_size"),
        ({"speculative": {"method": "magic"}}, "speculative.method"),
        ({"speculative": {"method": "eagle"}}, "speculative.draft_model"),
        ({"speculative": {"method": "ngram", "bogus": 1}}, "speculative"),
        ({"speculative": {"method": "ngram", "topk": 0}}, "speculative.topk"),
        (
            {"speculative": {"method": "ngram", "topk": 4, "num_draft_tokens": 300}},
            "speculative.num_draft_tokens",
        ),
        ({"device": "tpu"}, "device"),
        ({"dtype": "int8"}, "dtype"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling.max_replicas"),
        (
            {"autoscaling": {"look_back_period_s": 2, "metrics_interval_s": 2}},
            "autoscaling.look_back_period_s",
        ),
        ({"unknown_field": 1}, "unknown_field"),
        ({"tp_timeout_s": 0}, "tp_timeout_s"),
        ({"health_check_period_s": -1}, "health_check_period_s"),
        ({"max_body_bytes": 10}, "max_body_bytes"),
        ({"api_key": ""}, "api_key"),
        ({"speculative": None, "decode_steps": 65}, "decode_steps"),
        ({"decode_steps": 4}, "decode_steps"),  # with the default drafter: speculation's own loop
    ],
)
def test_serve_config_errors_name_the_field(args, field):
    with pytest.raises(ValidationError) as err:
        ServeConfig.model_validate(args)
    assert field in str(err.value)


def test_defaults_are_the_embedded_model_with_its_drafter():
    config = ServeConfig()
    engine = config.engine_config()
    assert engine.model == "smollm2-135m-instruct"
    # "default": the head shipped for the model if the package holds one, else n-gram (test_train_draft.py)
    assert engine.speculative == SpeculativeConfig.from_value(default_speculative(engine.model))
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert ServeConfig(speculative=None).engine_config().speculative is None
    assert ServeConfig(speculative=None).engine_config().decode_steps is None
    assert ServeConfig(speculative=None, decode_steps=0).engine_config().decode_steps == 0
    tree = ServeConfig(speculative={"method": "ngram", "topk": 4, "num_draft_tokens": 16}).engine_config()
    assert (tree.speculative.topk, tree.speculative.draft_tokens) == (4, 16)


def _ctx(current, ongoing, metrics, low=1, high=4):
    return SimpleNamespace(
        current_num_replicas=current,
        total_num_requests=ongoing,
        aggregated_metrics=metrics,
        capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high,
        policy_state={},
    )


def _per_replica(*reports: LoadReport) -> dict:
    metrics: dict = {}
    for i, report in enumerate(reports):
        for name, value in report.as_metrics().items():
            metrics.setdefault(name, {})[f"replica-{i}"] = value
    return metrics


TARGETS = dict(target_ongoing_requests=16, target_queue_depth=4, target_kv_usage=0.8, target_ttft_s=2.0)


def test_policy_follows_the_most_loaded_signal():
    idle = LoadReport(running=1, waiting=0, kv_usage=0.1, ttft_s=0.1)
    assert engine_load_policy(_ctx(1, 1, _per_replica(idle)), **TARGETS)[0] == 1
    queued = LoadReport(running=8, waiting=9, kv_usage=0.2, ttft_s=0.1)  # few requests, deep queue
    assert engine_load_policy(_ctx(1, 17, _per_replica(queued)), **TARGETS)[0] == 3
    full_kv = LoadReport(running=4, waiting=0, kv_usage=0.95, ttft_s=0.1)
    assert engine_load_policy(_ctx(2, 8, _per_replica(full_kv, full_kv)), **TARGETS)[0] == 3
    slow = LoadReport(running=4, waiting=0, kv_usage=0.1, ttft_s=5.0)
    assert engine_load_policy(_ctx(1, 4, _per_replica(slow)), **TARGETS)[0] == 3
    flood = LoadReport(running=64, waiting=200, kv_usage=1.0, ttft_s=30.0)
    assert engine_load_policy(_ctx(1, 264, _per_replica(flood)), **TARGETS)[0] == 4  # capped at max


def test_policy_scales_back_down_when_load_ends():
    idle = LoadReport(running=0, waiting=0, kv_usage=0.0, ttft_s=0.0)
    assert engine_load_policy(_ctx(2, 0, _per_replica(idle, idle)), **TARGETS)[0] == 1
    assert engine_load_policy(_ctx(2, 0, None), **TARGETS)[0] == 1  # no reports yet
    assert replicas_needed(3, 0, {}, **TARGETS) == 0


def test_fault_settings_reach_the_deployments():
    """The health probe period goes to Serve; the API key and body cap go to the ingress only (the
    engine replicas never need the key, so they never hold it)."""
    from specserve.serve.app import build_app

    config = ServeConfig(health_check_period_s=1.5, tp_timeout_s=30, api_key="k3y", max_body_bytes=4096)
    assert engine_deployment_options(config, gpu=False)["health_check_period_s"] == 1.5
    ingress = build_app(config)._bound_deployment
    engine_args, api_options = ingress.init_args[0]._bound_deployment.init_args[0], ingress.init_args[3]
    assert "api_key" not in engine_args and engine_args["tp_timeout_s"] == 30
    assert api_options == {"api_key": "k3y", "max_body_bytes": 4096}
