"""Every private Keras, JAX and Grain hook keras_dp uses, one small function each.

keras_dp uses public APIs wherever one exists. What is left here has no
public equivalent; each function names the private attribute it reads, and
`tests/test_compat.py` checks each one against the installed Keras, JAX
and Grain, so that a release that changes one fails there, loudly, not
deep in a run.

One module per library (`keras`, `jax`, `grain`); the rest of keras_dp
imports them from here, as `_compat.<hook>`.
"""

from keras_dp._compat.grain import (  # noqa: F401
    grain_elastic,
    grain_elastic_batch_size,
    grain_elastic_dataset,
    grain_elastic_pass,
    grain_inner_iterator,
    grain_loader_epochs,
    grain_repeat_epochs,
)
from keras_dp._compat.jax import (  # noqa: F401
    SERVICE_PROGRAM,
    detect_cluster,
    distributed_client,
    distributed_processes,
    jax_backend_started,
    joining_without_service,
    key_value_not_found,
    key_value_timed_out,
    live_processes,
    wait_at_barrier,
)
from keras_dp._compat.keras import (  # noqa: F401
    all_layers,
    compile_arguments,
    compiled_loss,
    compiled_metrics,
    compute_output_spec,
    custom_step,
    has_call,
    input_structure,
    is_jax_trainer,
    layout_map,
    loss_function,
    loss_tracker,
    metric_names,
    optimizer_trainable_variables,
    set_random_seed,
    sharded_birth,
    settle_monitor,
    shadow_state_sync,
    shut_down_callback_pool,
    slot_prefix,
    state_sync_shadowed,
    symbolic_build,
    take_initial_epoch,
    unsettled_monitor,
    unshadow_state_sync,
    variable_layout,
)
