"""Engine integrations (vLLM, Hugging Face transformers). Each imports its engine lazily."""
