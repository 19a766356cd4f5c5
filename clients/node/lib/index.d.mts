// The ESM entry re-exports the CommonJS module; so do its types.
export * from './index.cjs';
