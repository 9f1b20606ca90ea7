/*
 * ops_q8.c: tensors kept in 8 bits in the torch glue (encode_q8, decode_q8): the values,
 * their uint8 codes of the same shapes and their fp32 block scales checked, then the
 * kernel run.
 */
#include "call.h"

struct q8_job {
    struct ampc_list values;
    struct ampc_list codes;
    struct ampc_list scales;
};

ON_DEVICES(encode_q8, q8_job, &job->codes, &job->scales, &job->values)
ON_DEVICES(decode_q8, q8_job, &job->values, &job->codes, &job->scales)

/* The codes and scales of `values` (named values_name), checked, the scales against the
 * list the caller gave (encode: the values, decode: the codes); the job's lists. */
static struct q8_job take(struct call *c, struct list *values, const char *values_name,
                          struct list *codes, struct list *scales, int by_codes)
{
    struct q8_job job;
    job.values = float_list(c, values);
    check_count(c, codes, "codes", values, values_name);
    check_dtype(c, codes, aoti_torch_dtype_uint8(), "torch.uint8");
    check_same_shapes(c, codes, "codes", values, values_name);
    if (by_codes)
        check_block_scales(c, scales, "scales", codes, "codes");
    else
        check_block_scales(c, scales, "scales", values, values_name);
    job.codes = as_list(codes, AMPC_F32);       /* the kernels read bytes: the dtype is unused */
    job.scales = as_list(scales, AMPC_F32);
    check_overlap(c);
    return job;
}

void ampc_op_encode_q8(struct call *c, struct encode_q8_args *a)
{
    describe_all(c);
    struct q8_job job = take(c, a->src, "src", a->codes, a->scales, 0);
    run(c, encode_q8_on_cpu, encode_q8_on_cuda, &job);
}

void ampc_op_decode_q8(struct call *c, struct decode_q8_args *a)
{
    describe_all(c);
    struct q8_job job = take(c, a->dst, "dst", a->codes, a->scales, 1);
    run(c, decode_q8_on_cpu, decode_q8_on_cuda, &job);
}
