//! Says whether this process can use CUDA: the driver version, the device
//! count and whether `cuMemcpyBatchAsync` is there, or why not. Exit status
//! 0 when a device is usable, 3 when not (scripts/gpu-check.sh reads it).

use orbitkv_gpu::cuda::{self, CudaConfig, CudaCopyEngine};

fn main() {
    match cuda::probe().and_then(|info| {
        CudaCopyEngine::open(CudaConfig::default()).map(|engine| (info, engine.copy_api()))
    }) {
        Ok((info, api)) => {
            println!(
                "cuda: driver {}.{}, {} device(s), cuMemcpyBatchAsync {}, copy api {api:?}",
                info.version / 1000,
                info.version % 1000 / 10,
                info.devices,
                if info.batch_api { "yes" } else { "no" },
            );
        }
        Err(why) => {
            println!("no CUDA: {why}");
            std::process::exit(3);
        }
    }
}
