"""`build_app`: the Ray Serve application (ingress -> engine replicas) for one `ServeConfig`.

Serve config files name it as `import_path: specserve.serve:build_app` with the `ServeConfig` fields
under `args:`; `specserve serve` calls it directly.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from specserve.serve.config import ServeConfig
from specserve.serve.engine_replica import EngineReplica
from specserve.serve.ingress import Ingress
from specserve.serve.placement import engine_deployment_options, ingress_deployment_options, uses_gpu


def build_app(args: ServeConfig | dict[str, Any] | None = None) -> Application:
    """The application for `args` (a ServeConfig or its fields; validation errors name the field)."""
    config = args if isinstance(args, ServeConfig) else ServeConfig.model_validate(args or {})
    gpu = uses_gpu(config)
    # The engine replicas never see the API key; the ingress gets it as a plain string.
    engine_args = config.model_dump(exclude={"api_key"})
    engine = EngineReplica.options(**engine_deployment_options(config, gpu)).bind(engine_args, gpu)
    key = config.api_key.get_secret_value() if config.api_key is not None else None
    api_options = {"api_key": key, "max_body_bytes": config.max_body_bytes}
    return Ingress.options(**ingress_deployment_options(config)).bind(
        engine, config.model_name, config.metrics_push_interval_s, api_options
    )
