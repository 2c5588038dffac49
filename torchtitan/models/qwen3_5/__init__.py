"""Qwen3.5 (dense 0.8B-27B, MoE 35B-A3B and up): Gated DeltaNet linear attention in most layers, gated softmax
attention in every 4th (per `layer_types`), a SwiGLU or an MoE with a gated shared expert. docs/hybrid_attention.md.
"""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.moe import update_expert_bias
from torchtitan.components.moe.args import MoEConfig
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.distributed.pipeline import pipeline_model
from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs
from torchtitan.models.qwen3_5.flavors import qwen3_5_flavors
from torchtitan.models.qwen3_5.model import Qwen3_5
from torchtitan.models.qwen3_5.parallelize import parallelize_qwen3_5
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["Qwen3_5", "Qwen3_5ModelArgs", "qwen3_5_flavors"]

register_train_spec(
    TrainSpec(
        name="qwen3_5",
        model_cls=Qwen3_5,
        flavors=qwen3_5_flavors,
        parallelize_fn=parallelize_qwen3_5,
        pipelining_fn=pipeline_model,
        build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
        build_dataloader_fn=build_text_dataloader,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=Qwen3_5StateDictAdapter,
        # Dense flavors have no MoE layer: the bias update finds none and returns.
        post_optimizer_step_fns=(update_expert_bias,),
        config_section=("moe", MoEConfig),
    )
)
