"""Model definitions and loading from local Hugging Face folders."""
