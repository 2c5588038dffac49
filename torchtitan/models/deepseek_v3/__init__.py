"""DeepSeek-V3 (and the DeepSeek-V2-Lite shape): MLA attention + DeepSeekMoE, with expert parallel.

Brings the `moe` config section (balancing) and the aux-loss-free bias update after each optimizer step.
"""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.distributed.pipeline import pipeline_model
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.flavors import deepseek_v3_flavors
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseek_v3
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.components.moe import update_expert_bias
from torchtitan.components.moe.args import MoEConfig
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["DeepSeekV3Model", "DeepSeekV3ModelArgs", "deepseek_v3_flavors"]

register_train_spec(
    TrainSpec(
        name="deepseek_v3",
        model_cls=DeepSeekV3Model,
        flavors=deepseek_v3_flavors,
        parallelize_fn=parallelize_deepseek_v3,
        pipelining_fn=pipeline_model,
        build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
        build_dataloader_fn=build_text_dataloader,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        post_optimizer_step_fns=(update_expert_bias,),
        config_section=("moe", MoEConfig),
    )
)
