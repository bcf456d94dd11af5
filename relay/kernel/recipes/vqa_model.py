"""The VQA student network and its tokenizer, from configs (random weights) or mounted pretrained folders.

Image patches (ViT or BLIP-vision) and question states (BERT/RoBERTa, PhoBERT's architecture) each go through
a linear projection to the T5 width and are concatenated; with `params.fusion_layers` > 0 a small Transformer
encoder (the seed's "fusion layer") runs over the concatenated sequence, masked like it. T5 takes the result as
`encoder_outputs`, both for the training loss and for `generate`, so T5's own encoder never runs: a
config-built T5 has no encoder blocks (`num_layers=0`); a mounted pretrained one (VietT5) keeps its weights.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

log = logging.getLogger(__name__)

SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "eos_token": "</s>"}


def train_tokenizer(texts: list[str], vocab_size: int):
    """A WordLevel tokenizer trained in memory on questions and answers, wrapped for transformers.
    Deterministic (ties broken by the word), lowercased, punctuation split off."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIALS["unk_token"]))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, no prefix in a WordLevel vocab
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=1,
                                        special_tokens=list(SPECIALS.values()), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIALS)


def fusion_parameters(d_model: int, d_ff: int, layers: int) -> int:
    """Parameters of the fusion encoder: per layer attention 4d^2 + 4d, feed-forward 2*d*d_ff + d_ff + d,
    two LayerNorms 4d; one final LayerNorm 2d."""
    if layers == 0:
        return 0
    return layers * (4 * d_model * d_model + 2 * d_model * d_ff + d_ff + 9 * d_model) + 2 * d_model


class VQAStudent(nn.Module):
    def __init__(self, vision: nn.Module, question: nn.Module, decoder: nn.Module, *, fusion_layers: int = 0,
                 fusion_heads: int = 8, fusion_ff: Optional[int] = None, dropout: float = 0.0):
        super().__init__()
        self.vision, self.question, self.decoder = vision, question, decoder
        width = decoder.config.d_model
        self.vision_proj = nn.Linear(vision.config.hidden_size, width)
        self.question_proj = nn.Linear(question.config.hidden_size, width)
        self.fusion: Optional[nn.Module] = None  # absent at 0 layers: the state dict stays as before
        if fusion_layers:
            layer = nn.TransformerEncoderLayer(width, fusion_heads, fusion_ff or 4 * width, dropout=dropout,
                                               activation="gelu", batch_first=True, norm_first=True)
            self.fusion = nn.TransformerEncoder(layer, fusion_layers, norm=nn.LayerNorm(width),
                                                enable_nested_tensor=False)

    def encode(self, pixel_values, question_ids, question_mask):
        from transformers.modeling_outputs import BaseModelOutput

        patches = self.vision(pixel_values=pixel_values).last_hidden_state
        words = self.question(input_ids=question_ids, attention_mask=question_mask).last_hidden_state
        hidden = torch.cat([self.vision_proj(patches), self.question_proj(words)], dim=1)
        mask = torch.cat([question_mask.new_ones(patches.shape[:2]), question_mask], dim=1)
        if self.fusion is not None:
            hidden = self.fusion(hidden, src_key_padding_mask=mask == 0)
        return BaseModelOutput(last_hidden_state=hidden), mask

    def forward(self, pixel_values, question_ids, question_mask, labels) -> torch.Tensor:
        """Decoder logits for the answer `labels` (-100 = padding), teacher-forced."""
        encoded, mask = self.encode(pixel_values, question_ids, question_mask)
        # shifted here rather than passing labels: T5 would also compute a loss we do not use
        decoder_input_ids = self.decoder._shift_right(labels.contiguous())
        return self.decoder(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=decoder_input_ids,
                            use_cache=False).logits

    def generate(self, pixel_values, question_ids, question_mask, *, num_beams: int, max_new_tokens: int,
                 min_new_tokens: int = 0):
        encoded, mask = self.encode(pixel_values, question_ids, question_mask)
        extra = {"min_new_tokens": min_new_tokens} if min_new_tokens else {}  # the pre-flight's full length
        return self.decoder.generate(encoder_outputs=encoded, attention_mask=mask, num_beams=num_beams,
                                     max_new_tokens=max_new_tokens, do_sample=False, **extra)


def _vision(p, pretrained: Optional[str]) -> nn.Module:
    from transformers import AutoModel, BlipVisionConfig, BlipVisionModel, ViTConfig, ViTModel

    if pretrained:
        from transformers import AutoConfig

        if AutoConfig.from_pretrained(pretrained).model_type == "vit":  # its pooler is unused here
            return ViTModel.from_pretrained(pretrained, add_pooling_layer=False)
        model = AutoModel.from_pretrained(pretrained)
        return getattr(model, "vision_model", model)  # a full BLIP checkpoint: keep its vision tower
    shape = dict(image_size=p.image_size, patch_size=p.patch_size, hidden_size=p.vision_hidden,
                 num_hidden_layers=p.vision_layers, num_attention_heads=p.vision_heads,
                 intermediate_size=4 * p.vision_hidden)
    if p.vision_model == "blip":
        return BlipVisionModel(BlipVisionConfig(**shape, attention_dropout=p.dropout))
    return ViTModel(ViTConfig(**shape, hidden_dropout_prob=p.dropout, attention_probs_dropout_prob=p.dropout),
                    add_pooling_layer=False)


def _question(p, tokenizer, pretrained: Optional[str]) -> nn.Module:
    from transformers import AutoModel, BertConfig, BertModel, RobertaConfig, RobertaModel

    if pretrained:
        return AutoModel.from_pretrained(pretrained, add_pooling_layer=False)
    cfg: dict[str, Any] = dict(vocab_size=len(tokenizer), hidden_size=p.text_hidden, num_hidden_layers=p.text_layers,
                               num_attention_heads=p.text_heads, intermediate_size=4 * p.text_hidden,
                               hidden_dropout_prob=p.dropout, attention_probs_dropout_prob=p.dropout,
                               pad_token_id=tokenizer.pad_token_id)
    if p.question_model == "roberta":  # PhoBERT: positions start after the padding index
        return RobertaModel(RobertaConfig(**cfg, max_position_embeddings=p.question_max_len + 2),
                            add_pooling_layer=False)
    return BertModel(BertConfig(**cfg, max_position_embeddings=p.question_max_len), add_pooling_layer=False)


def _decoder(p, tokenizer, pretrained: Optional[str]) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    if pretrained:
        model = T5ForConditionalGeneration.from_pretrained(pretrained)
    else:
        # No encoder blocks: the vision and question encoders feed `encoder_outputs`, T5's own encoder never
        # runs (it was 85M of the real size's 447.5M parameters, 340 MB in every checkpoint). generate() works with
        # it, cached or not, beams or not (older transformers raised IndexError in the cache when
        # num_decoder_layers > num_layers; the VQA recipe's tests generate with it).
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=len(tokenizer), d_model=p.d_model, d_kv=p.d_kv, d_ff=p.d_ff, num_layers=0,
            num_decoder_layers=p.decoder_layers, num_heads=p.decoder_heads, dropout_rate=p.dropout,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=True))
    g = model.generation_config
    g.pad_token_id, g.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    g.decoder_start_token_id = model.config.decoder_start_token_id
    g.max_length = None
    return model


def build_student(p, q_tokenizer, a_tokenizer, pretrained: dict[str, Optional[str]]) -> VQAStudent:
    return VQAStudent(_vision(p, pretrained["vision_pretrained"]),
                      _question(p, q_tokenizer, pretrained["question_pretrained"]),
                      _decoder(p, a_tokenizer, pretrained["decoder_pretrained"]),
                      fusion_layers=p.fusion_layers, fusion_heads=p.fusion_heads, fusion_ff=p.d_ff,
                      dropout=p.dropout)


def enable_decoder_checkpointing(model: VQAStudent) -> bool:
    """Activation checkpointing on the T5 decoder (the seed's setting: it holds most activations)."""
    decoder = model.decoder
    kwargs = {"use_reentrant": False}
    if hasattr(decoder, "activation_checkpointing_enable"):  # transformers >= 5: the non-deprecated name
        decoder.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True
