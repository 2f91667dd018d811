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
    engine = EngineReplica.options(**engine_deployment_options(config, gpu)).bind(config.model_dump(), gpu)
    return Ingress.options(**ingress_deployment_options(config)).bind(
        engine, config.model_name, config.metrics_push_interval_s
    )
