"""The OpenAI-compatible server: `create_app(async_llm, tokenizer, model_name)` builds the FastAPI app that
`brrr serve` runs on uvicorn (see docs/serving.md). Imported lazily, so `brrr --help` does not load FastAPI."""


def __getattr__(name):
    if name == "create_app":
        from brrr.server.app import create_app

        return create_app
    raise AttributeError(name)


__all__ = ["create_app"]
