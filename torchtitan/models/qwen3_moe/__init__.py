"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 attention with an MoE layer in every block, with expert parallel.

Brings the `moe` config section and the aux-loss-free bias update after each optimizer step.
"""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.moe import update_expert_bias
from torchtitan.components.moe.args import MoEConfig
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.distributed.pipeline import pipeline_model
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs
from torchtitan.models.qwen3_moe.flavors import qwen3_moe_flavors
from torchtitan.models.qwen3_moe.model import Qwen3Moe
from torchtitan.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from torchtitan.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["Qwen3Moe", "Qwen3MoeModelArgs", "qwen3_moe_flavors"]

register_train_spec(
    TrainSpec(
        name="qwen3_moe",
        model_cls=Qwen3Moe,
        flavors=qwen3_moe_flavors,
        parallelize_fn=parallelize_qwen3_moe,
        pipelining_fn=pipeline_model,
        build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
        build_dataloader_fn=build_text_dataloader,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=Qwen3MoeStateDictAdapter,
        post_optimizer_step_fns=(update_expert_bias,),
        config_section=("moe", MoEConfig),
    )
)
