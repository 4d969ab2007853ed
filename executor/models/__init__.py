"""The model: shared building blocks (`blocks`, `rotary`) and one description per family (`families`)."""
