"""What other libraries' models need from zerostack (Hugging Face Transformers: ``hf``).

Nothing here imports those libraries unless the user already has: zerostack never depends on them.
"""
