"""The Gradio studio: one module per tab, a thin layer over ``studio.controller.Studio``."""
