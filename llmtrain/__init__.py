"""llmtrain: fine-tune 7B-class Llama and Mistral models with Hugging Face Accelerate."""

__version__ = "0.1.0"
