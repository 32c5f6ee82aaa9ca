"""Recipes shipped as package data (YAML files)."""
