"""python -m inference_service: the inference worker (its flags: server/main.py, or --help)."""

from inference_service.server.main import main

if __name__ == "__main__":
    main()
