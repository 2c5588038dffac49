"""GPT-OSS (openai/gpt-oss-20b, -120b): attention sinks and sliding windows (kinds of the shared attention
kernel), YaRN, and an MoE layer with biases and a clamped SwiGLU in every block, with expert parallel; HF
folders in and out, the published MXFP4 experts dequantized on load.

Brings the `moe` config section and the aux-loss-free bias update after each optimizer step.
"""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.moe import update_expert_bias
from torchtitan.components.moe.args import MoEConfig
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.distributed.pipeline import pipeline_model
from torchtitan.models.gpt_oss.args import GptOssModelArgs
from torchtitan.models.gpt_oss.flavors import gpt_oss_flavors
from torchtitan.models.gpt_oss.model import GptOss
from torchtitan.models.gpt_oss.parallelize import parallelize_gpt_oss
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["GptOss", "GptOssModelArgs", "gpt_oss_flavors"]

register_train_spec(
    TrainSpec(
        name="gpt_oss",
        model_cls=GptOss,
        flavors=gpt_oss_flavors,
        parallelize_fn=parallelize_gpt_oss,
        pipelining_fn=pipeline_model,
        build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
        build_dataloader_fn=build_text_dataloader,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=GptOssStateDictAdapter,
        post_optimizer_step_fns=(update_expert_bias,),
        config_section=("moe", MoEConfig),
    )
)
