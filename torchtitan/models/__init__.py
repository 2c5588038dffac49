"""Model folders. Importing one registers its train spec; add yours here."""

from torchtitan.models import llama3  # noqa: F401
from torchtitan.models import deepseek_v3  # noqa: F401
from torchtitan.models import qwen3  # noqa: F401
from torchtitan.models import qwen3_moe  # noqa: F401
from torchtitan.models import qwen3_5  # noqa: F401
from torchtitan.models import gpt_oss  # noqa: F401
