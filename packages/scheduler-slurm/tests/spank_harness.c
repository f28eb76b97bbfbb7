/*
 * Test harness for rota_spank.c: compiles the plugin's own source together with stub
 * versions of the SPANK calls it makes, so a test can run its user_init and task_init
 * on a given step environment without Slurm (tests/test_slurm_groups.py, via ctypes).
 * Built with -I pointing at the plugin's directory and the real <slurm/spank.h>, so the
 * stubs must match Slurm's declarations.
 */
#include <stdarg.h>

#include "rota_spank.c"

#define HARNESS_VARS 64
#define HARNESS_LEN 512

static char env_keys[HARNESS_VARS][HARNESS_LEN], env_vals[HARNESS_VARS][HARNESS_LEN];
static int env_n = 0;
static char set_log[8192];
static char last_error[1024];
static uint32_t item_step, item_nnodes, item_rank, item_world;

static int env_find(const char *var)
{
    int i;
    for (i = 0; i < env_n; i++)
        if (strcmp(env_keys[i], var) == 0)
            return i;
    return -1;
}

/* "K=V\nK=V\n" replaces the environment the stubs serve. */
static void env_load(const char *text)
{
    const char *p = text;
    env_n = 0;
    while (p && *p && env_n < HARNESS_VARS) {
        const char *nl = strchr(p, '\n'), *eq = strchr(p, '=');
        size_t line = nl ? (size_t)(nl - p) : strlen(p);
        if (eq && (size_t)(eq - p) < line) {
            snprintf(env_keys[env_n], HARNESS_LEN, "%.*s", (int)(eq - p), p);
            snprintf(env_vals[env_n], HARNESS_LEN, "%.*s", (int)(line - (size_t)(eq - p) - 1), eq + 1);
            env_n++;
        }
        p = nl ? nl + 1 : NULL;
    }
}

int spank_remote(spank_t sp)
{
    (void)sp;
    return 1;
}

spank_context_t spank_context(void)
{
    return S_CTX_REMOTE;
}

spank_err_t spank_option_register(spank_t sp, struct spank_option *opt)
{
    (void)sp;
    (void)opt;
    return ESPANK_SUCCESS;
}

spank_err_t spank_option_getopt(spank_t sp, struct spank_option *opt, char **optarg)
{
    (void)sp;
    (void)opt;
    (void)optarg;
    return ESPANK_ERROR;
}

spank_err_t spank_get_item(spank_t sp, spank_item_t item, ...)
{
    va_list ap;
    uint32_t *out;
    (void)sp;
    va_start(ap, item);
    out = va_arg(ap, uint32_t *);
    va_end(ap);
    switch (item) {
    case S_JOB_ID: *out = 42; return ESPANK_SUCCESS;
    case S_JOB_STEPID: *out = item_step; return ESPANK_SUCCESS;
    case S_JOB_NNODES: *out = item_nnodes; return ESPANK_SUCCESS;
    case S_TASK_GLOBAL_ID: *out = item_rank; return ESPANK_SUCCESS;
    case S_JOB_TOTAL_TASK_COUNT: *out = item_world; return ESPANK_SUCCESS;
    default: return ESPANK_BAD_ARG;
    }
}

spank_err_t spank_getenv(spank_t sp, const char *var, char *buf, int len)
{
    int i = env_find(var);
    (void)sp;
    if (i < 0)
        return ESPANK_ENV_NOEXIST;
    snprintf(buf, (size_t)len, "%s", env_vals[i]);
    return ESPANK_SUCCESS;
}

spank_err_t spank_setenv(spank_t sp, const char *var, const char *val, int overwrite)
{
    size_t o = strlen(set_log);
    (void)sp;
    (void)overwrite;
    snprintf(set_log + o, sizeof(set_log) - o, "%s=%s\n", var, val);
    return ESPANK_SUCCESS;
}

spank_err_t spank_unsetenv(spank_t sp, const char *var)
{
    size_t o = strlen(set_log);
    (void)sp;
    snprintf(set_log + o, sizeof(set_log) - o, "-%s\n", var);
    return ESPANK_SUCCESS;
}

spank_err_t spank_job_control_setenv(spank_t sp, const char *name, const char *value, int overwrite)
{
    (void)sp;
    (void)name;
    (void)value;
    (void)overwrite;
    return ESPANK_SUCCESS;
}

void slurm_info(const char *format, ...)
{
    (void)format;
}

void slurm_error(const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    vsnprintf(last_error, sizeof(last_error), format, ap);
    va_end(ap);
}

/*
 * Run `--timeslice=GROUP` through option parsing, user_init (with step_env, what
 * slurmstepd has before the tasks fork) and task_init (with task_env, one task's
 * environment). Returns 0 and writes the env the plugin set ("K=V" lines, "-K" for an
 * unset) to out; or -1 (a callback failed) / -2 (the option was refused) and writes
 * the plugin's error message to out.
 */
int rota_harness_run(const char *group, const char *step_env, const char *task_env, uint32_t step,
                     uint32_t nnodes, uint32_t rank, uint32_t world, char *out, int len)
{
    have_group = 0;
    have_priority = 0;
    opt_group[0] = '\0';
    step_gpus[0] = '\0';
    set_log[0] = '\0';
    last_error[0] = '\0';
    item_step = step;
    item_nnodes = nnodes;
    item_rank = rank;
    item_world = world;
    if (opt_group_cb(0, group, 1) != ESPANK_SUCCESS) {
        snprintf(out, (size_t)len, "%s", last_error);
        return -2;
    }
    env_load(step_env);
    if (slurm_spank_user_init(NULL, 0, NULL) != ESPANK_SUCCESS) {
        snprintf(out, (size_t)len, "%s", last_error);
        return -1;
    }
    env_load(task_env);
    if (slurm_spank_task_init(NULL, 0, NULL) != ESPANK_SUCCESS) {
        snprintf(out, (size_t)len, "%s", last_error);
        return -1;
    }
    snprintf(out, (size_t)len, "%s", set_log);
    return 0;
}
