//! `Model::set_dump_dir`: a forward pass writes its intermediate tensors there, and nowhere
//! when it is off (the CLI sets it from FERROLM_DUMP; library code reads no environment).

use std::sync::Arc;

use ferrolm_gguf::GgufFile;
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model};

#[test]
fn a_pass_writes_its_tensors_where_the_model_is_told() {
    let spec = SyntheticSpec::small("llama");
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
    let mut model = Model::from_file(file, 1).unwrap();
    let dir = std::env::temp_dir().join(format!("ferrolm-dump-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ids = [1u32, 2, 3];
    model.session(8).eval(&ids, Logits::Last).unwrap();
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "off by default"
    );
    model.set_dump_dir(Some(dir.clone()));
    model.session(8).eval(&ids, Logits::Last).unwrap();
    let norm = std::fs::read(dir.join("attn_norm-0.f32")).unwrap();
    assert_eq!(norm.len(), 4 * ids.len() * spec.n_embd, "every token's row");
    assert!(dir.join(format!("l_out-{}.f32", spec.n_layer - 1)).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
