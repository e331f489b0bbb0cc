"""Post-training objectives: advantages, distillation targets, environments (AVSD, AEM, ABC-Align)."""
