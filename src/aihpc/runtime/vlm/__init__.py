"""The trainer's vision-language model (a spec with ``[model.vision]``): the images and captions
it generates (``images``), the ViT, projector and decoder (``model``), the plan applied to them
(``parallel``), the step (``step``), the job's setup (``job``) and the summary's measured against
predicted (``summary``). docs/multimodal.md, "Training a tiny VLM"."""
